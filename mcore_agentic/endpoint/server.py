"""The endpoint's HTTP face: per-session OpenAI and Anthropic routes on a FastAPI app, served by uvicorn.

Routes, under each session's base ``/sessions/{id}``:

* ``POST /v1/chat/completions`` (OpenAI Chat Completions), ``POST /v1/responses`` (OpenAI Responses),
  ``POST /v1/messages`` (Anthropic Messages), each whole or streamed (server-sent events);
* ``POST /v1/messages/count_tokens`` (Anthropic): the prompt tokens of the request's render;
* ``GET /v1/models``;
* ``POST /reward`` — ``{"reward": float}`` adds to the session's reward; ``{"reward": float, "turn": id}`` also
  makes it the own reward of the turn that returned response ``id`` (or ``"latest"``: the last turn sampled);
* ``GET /samples`` — the session's samples (ids, text pieces, loss mask, log-probs, fork reasons).

The first two items are the routes of the client APIs registered in :data:`APIS` (each a :class:`~.api.ChatApi`).

Security: the server binds to loopback unless told otherwise. Every session has its own random token, sent as
``Authorization: Bearer`` (OpenAI clients) or ``x-api-key`` (Anthropic clients); a token opens only its own
session, and an unknown session answers exactly like a wrong token (401), so ids cannot be probed. No route
lists sessions. Bodies are capped (413 before the body is read past the cap); malformed JSON and wrong types get a
4xx in the calling API's error shape, fields that change nothing here are accepted and counted
(:mod:`.field_policy`); an unexpected error is logged and answered 500 in
that shape, never taking the server down. The standalone server (:mod:`.serve`) adds ``POST /sessions`` behind
its own admin token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mcore_agentic.endpoint import anthropic_messages, field_policy, openai_chat, responses
from mcore_agentic.endpoint.api import ChatApi
from mcore_agentic.endpoint.session import Session
from mcore_agentic.endpoint.turn import ApiError, TurnRequest

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
"""The model id ``/v1/models`` lists; requests may name any model."""

APIS: dict[str, ChatApi] = {api.name: api for api in (openai_chat.API, responses.API, anthropic_messages.API)}
"""The client APIs every session serves, by name: :func:`build_app` adds each one's routes. To add an API: a module
that builds a :class:`~.api.ChatApi`, and its entry here."""

BASE_API = openai_chat.API
"""The API whose error shape the routes of no API (models, reward, samples) answer in."""


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 4 * 2**20
    """Largest request body."""


class SessionRegistry:
    """The live sessions of an endpoint, by id; thread-safe (the rollout adds, the server reads)."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def add(self, session: Session) -> None:
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"session {session.id} exists")
            self._sessions[session.id] = session

    def remove(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def authorised(self, session_id: str, token: str | None) -> Session:
        """The session ``token`` opens; 401 for a wrong token and for an unknown session alike."""
        with self._lock:
            session = self._sessions.get(session_id)
        expected = session.token if session is not None else secrets.token_urlsafe(32)
        if token is None or not secrets.compare_digest(token.encode(), expected.encode()) or session is None:
            raise ApiError(401, "invalid API key for this session", type="authentication_error", code="invalid_api_key")
        return session

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


def request_token(headers: Any) -> str | None:
    """The bearer token (OpenAI clients) or ``x-api-key`` (Anthropic clients) of a request."""
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key")


async def _read_json(request: Request, max_bytes: int) -> Any:
    """The request's JSON body; 413 past ``max_bytes`` (declared or read), 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise ApiError(413, f"request body over the endpoint's limit of {max_bytes} bytes",
                       type="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"request body over the endpoint's limit of {max_bytes} bytes",
                           type="request_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None


def _failure(api: ChatApi, session_id: str, exc: Exception) -> JSONResponse:
    """An :class:`ApiError` as itself; anything else logged and answered 500, in the API's shape."""
    if isinstance(exc, ApiError):
        return _error(api, exc)
    logger.exception("session %s: %s failed", session_id, api.name, exc_info=exc)
    return _error(api, ApiError(500, f"internal error: {type(exc).__name__}", type="api_error"))


def _error(api: ChatApi, exc: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(api.error_body(exc), status_code=exc.status, headers=headers)


def _parse(api: ChatApi, parser: Callable[[Any], TurnRequest], body: Any, headers: Any) -> TurnRequest:
    """``body`` parsed by ``parser``; the fields it ignored logged once per name (:mod:`.field_policy`)."""
    parsed = parser(body)
    sent = tuple(name for name in api.ignored_headers if headers.get(name))
    if sent:
        parsed = dataclasses.replace(parsed, ignored=(*parsed.ignored, *sent))
    field_policy.log_new(parsed.ignored, api.name, api.known_fields)
    return parsed


@dataclass(frozen=True)
class _Routes:
    """The route handlers :func:`build_app` registers, over one registry: each takes the path's session id and the
    raw request, and answers every failure in its API's error shape (:data:`BASE_API`'s for the routes of none)."""

    registry: SessionRegistry
    limits: Limits

    async def _json(self, request: Request) -> Any:
        return await _read_json(request, self.limits.max_request_bytes)

    async def turn(self, api: ChatApi, session_id: str, request: Request) -> Any:
        try:
            session = self.registry.authorised(session_id, request_token(request.headers))
            parsed = _parse(api, api.parse_request, await self._json(request), request.headers)
            check_tool_choice(parsed)
            result = await session.complete(parsed, disconnected=request.is_disconnected)
        except Exception as exc:  # noqa: BLE001 -- one request's failure is its own, never the server's
            return _failure(api, session_id, exc)
        if parsed.stream:
            return StreamingResponse(_frames(api.stream_events(result, parsed)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(api.response_body(result, parsed))

    async def count_tokens(self, api: ChatApi, parser: Callable[[Any], TurnRequest], session_id: str,
                           request: Request) -> Any:
        try:
            session = self.registry.authorised(session_id, request_token(request.headers))
            parsed = _parse(api, parser, await self._json(request), request.headers)
            return JSONResponse({"input_tokens": session.count_tokens(parsed)})
        except Exception as exc:  # noqa: BLE001
            return _failure(api, session_id, exc)

    async def models(self, session_id: str, request: Request) -> Any:
        try:
            self.registry.authorised(session_id, request_token(request.headers))
        except Exception as exc:  # noqa: BLE001
            return _failure(BASE_API, session_id, exc)
        return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                                         "owned_by": "mcore-agentic"}]})

    async def reward(self, session_id: str, request: Request) -> Any:
        try:
            session = self.registry.authorised(session_id, request_token(request.headers))
            body = await self._json(request)
            if not isinstance(body, dict) or "reward" not in body or not set(body) <= {"reward", "turn"}:
                raise ApiError(400, 'the body must be {"reward": <number>} or {"reward": <number>, "turn": '
                                    '<response id or "latest">}', param="reward")
            value, turn = body["reward"], body.get("turn")
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
                raise ApiError(400, f"reward must be a finite number, got {value!r}", param="reward")
            if turn is not None and (not isinstance(turn, str) or not turn or len(turn) > 256):
                raise ApiError(400, f'turn must be a response id or "latest", got {str(turn)[:64]!r}', param="turn")
            session.post_reward(float(value), turn)
        except Exception as exc:  # noqa: BLE001
            return _failure(BASE_API, session_id, exc)
        return JSONResponse({"session_id": session_id, "reward": session.reward})

    async def samples(self, session_id: str, request: Request) -> Any:
        try:
            session = self.registry.authorised(session_id, request_token(request.headers))
            return JSONResponse(session.summary())
        except Exception as exc:  # noqa: BLE001
            return _failure(BASE_API, session_id, exc)


def build_app(registry: SessionRegistry, limits: Limits = Limits(), *, admin: Callable[[Any], None] | None = None) -> Any:
    """The FastAPI app serving ``registry``'s sessions. ``admin``: the standalone server's extra routes."""
    app = FastAPI(title="mcore-agentic session endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    routes = _Routes(registry, limits)

    def route(path: str, method: str, handler: Callable[[str, Request], Any]) -> None:
        """A plain Starlette route: FastAPI's dependency solving costs more per request than the rest of a
        turn's HTTP handling, and these handlers read only the path's session id and the raw request."""

        async def endpoint(request: Request) -> Any:
            return await handler(request.path_params["session_id"], request)

        app.add_route(path, endpoint, methods=[method])

    base = "/sessions/{session_id}"
    for api in APIS.values():
        route(f"{base}{api.path}", "POST", functools.partial(routes.turn, api))
        if api.count_tokens_path is not None and api.parse_count_request is not None:
            route(f"{base}{api.count_tokens_path}", "POST",
                  functools.partial(routes.count_tokens, api, api.parse_count_request))
    route(f"{base}/v1/models", "GET", routes.models)
    route(f"{base}/reward", "POST", routes.reward)
    route(f"{base}/samples", "GET", routes.samples)

    if admin is not None:
        admin(app)
    return app


def check_tool_choice(request: Any) -> None:
    """A ``tool_choice`` naming one tool must name one the request offers; ``required`` needs tools (OpenAI and
    Anthropic refuse both the same way)."""
    names = {t["function"]["name"] for t in request.tools or []}
    if request.tool_choice == "required" and not names:
        raise ApiError(400, "tool_choice requires a tool call but the request offers no tools", param="tool_choice")
    if request.tool_choice not in ("auto", "none", "required") and request.tool_choice not in names:
        raise ApiError(400, f"tool_choice names {request.tool_choice!r}, which is not among the request's tools "
                            f"{sorted(names)}", param="tool_choice")


async def _frames(events: Iterator[str]) -> AsyncIterator[bytes]:
    for frame in events:
        yield frame.encode()
        await asyncio.sleep(0)  # a disconnected client cancels the stream here


class EndpointServer:
    """Serves an app with uvicorn on a thread of its own (its own event loop), so the rollout's event loop and a
    program that blocks it never stall the endpoint. ``port=0`` takes a free port; :attr:`url` says which."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, unix_path: str | None = None):
        import os
        import socket

        import uvicorn

        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        # Also a Unix-domain socket (sandboxed agent commands reach the endpoint through it, bind-mounted into their
        # sandbox): mode 0666, so a sandbox's unprivileged uid may connect; its directory is what guards it.
        self.unix_path = unix_path
        self._unix: socket.socket | None = None
        if unix_path is not None:
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind(unix_path)
            os.chmod(unix_path, 0o666)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30,
                                limit_concurrency=4096)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="agent-endpoint", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the agent endpoint failed to start on {host}:{self.port}")
            self._thread.join(0.01)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket] + ([self._unix] if self._unix is not None else [])))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
        if self._unix is not None:
            import contextlib
            import os

            self._unix.close()
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
