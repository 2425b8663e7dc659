"""Standalone mode: serve a model directory's sessions to develop an agent program before training.

``python -m mcore_agentic.endpoint serve --model DIR`` loads an HF-format model (a ``launch/export_hf.py``
export, say) and its tokenizer into an engine and serves the session endpoint. It prints an admin token once;
``POST /sessions`` with it (``Authorization: Bearer <admin token>``) opens a session and returns its id, its
own API key and its base URLs. The session's routes are the training endpoint's (``endpoint/server.py``),
``GET /sessions/{id}/samples`` included: the exact ids, text pieces, loss mask, log-probs and fork reasons the
trainer would train on. Here the client's sampling settings (temperature, top_p) are honoured.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from mcore_agentic.endpoint.server import EndpointServer, Limits, SessionRegistry, build_app, request_token
from mcore_agentic.endpoint.session import Session, SessionSettings
from mcore_agentic.endpoint.turn import ApiError
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Model:
    model_path: str
    dtype: str
    routing_shape: tuple[int, int] | None = None


def session_admin(registry: SessionRegistry, factory: Any, admin_token: str, max_sessions: int) -> Any:
    """The standalone server's ``POST /sessions`` (admin token only) and ``DELETE /sessions/{id}`` (its own token)."""

    def install(app: Any) -> None:
        def refuse(exc: ApiError) -> JSONResponse:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            return JSONResponse({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                                           "code": exc.code}}, status_code=exc.status, headers=headers)

        @app.post("/sessions")
        async def open_session(request: Request) -> Any:
            token = request_token(request.headers)
            if token is None or not secrets.compare_digest(token.encode(), admin_token.encode()):
                return refuse(ApiError(401, "invalid admin token", type="authentication_error"))
            if len(registry) >= max_sessions:
                return refuse(ApiError(429, f"{max_sessions} sessions are open, the limit: delete one",
                                       type="rate_limit_error"))
            session: Session = factory()
            registry.add(session)
            base = f"{request.base_url}sessions/{session.id}"
            return {"session_id": session.id, "api_key": session.token, "base_url": f"{base}/v1",
                    "anthropic_base_url": base}

        @app.delete("/sessions/{session_id}")
        async def close_session(session_id: str, request: Request) -> Any:
            try:
                registry.authorised(session_id, request_token(request.headers))
            except ApiError as exc:
                return refuse(exc)
            registry.remove(session_id)
            return {"session_id": session_id, "deleted": True}

    return install


def serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mcore_agentic.endpoint serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="an HF-format model directory (config, weights, tokenizer)")
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm", "sglang"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1", help="loopback by default; anything else serves the network")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tool-format", default="hermes", help="the model's tool-call format (rollout.multi_turn.format)")
    parser.add_argument("--prompt-length", type=int, default=4096)
    parser.add_argument("--response-length", type=int, default=4096)
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from transformers import AutoConfig, AutoTokenizer

    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines import build_engine

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = getattr(AutoConfig.from_pretrained(args.model), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        parser.exit(2, f"error: --model: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                       f"{vocab}: its special tokens would index past the embedding; export the model with its own "
                       "tokenizer\n")
    cfg = RolloutConfig(name=args.engine, prompt_length=args.prompt_length, response_length=args.response_length)
    engine = build_engine(cfg, _Model(args.model, args.dtype), device=args.device, seed=args.seed)
    bound = getattr(engine, "event_loop", None)  # SGLang: its loop must run for the sessions' calls (engine_call)
    if bound is not None and not bound.is_running():
        threading.Thread(target=bound.run_forever, name="engine-loop", daemon=True).start()
    chat = ChatTokenizer(tokenizer)
    settings = SessionSettings(prompt_length=cfg.prompt_length, response_length=cfg.response_length,
                               max_model_len=cfg.effective_max_model_len, honor_client_sampling=True)
    tool_parser = get_tool_parser(args.tool_format)
    registry = SessionRegistry()
    admin_token = secrets.token_urlsafe(32)

    def new_session() -> Session:
        return Session(uuid.uuid4().hex, engine=engine, chat=chat, parser=tool_parser, settings=settings,
                       seed=args.seed)

    app = build_app(registry, Limits(), admin=session_admin(registry, new_session, admin_token, args.max_sessions))
    server = EndpointServer(app, host=args.host, port=args.port)
    print(f"serving {args.model} on {server.url}\nadmin token: {admin_token}\n"
          f"open a session: curl -X POST -H 'Authorization: Bearer {admin_token}' {server.url}/sessions", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()
        shutdown = getattr(engine, "shutdown", None)  # its scheduler thread ends before the interpreter does
        if shutdown is not None:
            shutdown()
