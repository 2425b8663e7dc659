"""The session endpoint's security rules (``endpoint/server.py``'s docstring), one test per rule, against a live
server: per-session tokens (a wrong, missing or other session's token and an unknown session all answer the same
401, in the calling API's error shape, and change nothing), no route lists sessions, capped bodies (413 with and
without a Content-Length), strict request validation (400 naming the field), a model's malformed or unoffered tool
call stays text, abusive clients (a stream dropped mid-way, a body that never comes) do not stop the server, agent
programs that hang, raise or return junk end as outcomes, loopback by default, and the standalone admin route.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pytest

from mcore_agentic.endpoint.programs import ProgramOutcome, SessionAccess, run_program
from mcore_agentic.endpoint.server import EndpointServer, Limits, SessionRegistry, build_app
from mcore_agentic.endpoint.session import Session
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser
from tests.helpers.endpoint import SETTINGS, Endpoint, qwen_tokenizer, scripted, serve
from tests.unit.rollout.scripted import call

LIMIT = 8192
"""The module's endpoint body cap (``Limits.max_request_bytes``)."""

TOOLS = [{"type": "function", "function": {"name": "read_meter", "description": "Read one meter.", "parameters": {
    "type": "object", "properties": {"meter": {"type": "string"}}, "required": ["meter"]}}}]
USER = {"role": "user", "content": "What do the meters read?"}
CHAT = {"model": "policy", "messages": [USER]}
RESPONSES = {"model": "policy", "input": "What do the meters read?"}
MESSAGES = {"model": "policy", "max_tokens": 64, "messages": [USER]}

# name: (method, path under /sessions/{id}, a body that succeeds with the right token, error shape)
ROUTES: dict[str, tuple[str, str, dict[str, Any] | None, str]] = {
    "chat": ("POST", "/v1/chat/completions", CHAT, "openai"),
    "responses": ("POST", "/v1/responses", RESPONSES, "openai"),
    "messages": ("POST", "/v1/messages", MESSAGES, "anthropic"),
    "count_tokens": ("POST", "/v1/messages/count_tokens", {"model": "policy", "messages": [USER]}, "anthropic"),
    "models": ("GET", "/v1/models", None, "openai"),
    "reward": ("POST", "/reward", {"reward": 1.0}, "openai"),
    "samples": ("GET", "/samples", None, "openai"),
}
TURN_ROUTES = ("chat", "responses", "messages")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    yield from serve(Limits(max_request_bytes=LIMIT))


@pytest.fixture
def ep(endpoint: Endpoint) -> Iterator[Endpoint]:
    yield endpoint
    endpoint.close_sessions()


@pytest.fixture
def http(endpoint: Endpoint) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=endpoint.url, timeout=10) as client:
        yield client


def _session(ep: Endpoint, script: list[str] | None = None, **settings: Any) -> Session:
    engine = scripted({"meters": script or ["The meters read 47 kWh."]})
    return ep.open(engine, settings=replace(SETTINGS, **settings) if settings else SETTINGS)


def _send(http: httpx.Client, route: str, session_id: str, token: str | None, *, body: Any = None,
          header: str = "authorization", **kw: Any) -> httpx.Response:
    method, path, default, _ = ROUTES[route]
    headers = kw.pop("headers", {})
    if token is not None:
        headers[header] = f"Bearer {token}" if header == "authorization" else token
    if "content" not in kw:
        kw["json"] = default if body is None else body
        if method == "GET":
            kw.pop("json")
    return http.request(method, f"/sessions/{session_id}{path}", headers=headers, **kw)


def _assert_error(response: httpx.Response, status: int, shape: str) -> dict[str, Any]:
    """The response is ``status`` with the API's error object; returns that object's inner error."""
    assert response.status_code == status, response.text
    body = response.json()
    if shape == "openai":
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    else:
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["message"]
    return body["error"]


def _state(session: Session) -> str:
    return json.dumps(session.summary(), sort_keys=True)


# ------------------------------------------------------------------------------------------------ tokens
def test_a_wrong_token_is_refused_in_each_clients_shape(ep):
    session = _session(ep)
    chat = openai.OpenAI(base_url=ep.openai_url(session), api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        chat.chat.completions.create(model="policy", messages=[USER])
    assert e.value.status_code == 401 and e.value.response.headers["www-authenticate"] == "Bearer"
    assert e.value.response.json() == {"error": {"message": "invalid API key for this session",
                                                 "type": "authentication_error", "param": None,
                                                 "code": "invalid_api_key"}}
    with pytest.raises(openai.AuthenticationError):
        chat.responses.create(model="policy", input="What do the meters read?")
    with pytest.raises(openai.AuthenticationError):
        chat.models.list()
    claude = anthropic.Anthropic(base_url=ep.anthropic_url(session), api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude.messages.create(model="policy", max_tokens=64, messages=[USER])
    assert e.value.response.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                   "message": "invalid API key for this session"}}
    assert session.samples == [] and not session.counts and session.engine.generations == []


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_answers_one_401_to_no_wrong_foreign_token_or_unknown_session(ep, http, route):
    """No token, a wrong token, another session's token and an unknown session id: the same 401 body, so neither
    a token nor a session id can be probed; nothing in either session changes."""
    shape = ROUTES[route][3]
    mine, other = _session(ep), _session(ep)
    for s in (mine, other):  # both hold a sample, a request and a reward first
        assert _send(http, "chat", s.id, s.token).status_code == 200
        assert _send(http, "reward", s.id, s.token).status_code == 200
    before = _state(mine), _state(other)
    refusals = {
        "none": _send(http, route, mine.id, None),
        "bearer, no token": _send(http, route, mine.id, None, headers={"authorization": "Bearer"}),
        "basic": _send(http, route, mine.id, None, headers={"authorization": f"Basic {mine.token}"}),
        "wrong": _send(http, route, mine.id, mine.token[::-1]),
        "wrong x-api-key": _send(http, route, mine.id, "nope", header="x-api-key"),
        "other session's": _send(http, route, mine.id, other.token),
        "other session's x-api-key": _send(http, route, mine.id, other.token, header="x-api-key"),
        "unknown session": _send(http, route, "0123456789abcdef", mine.token),
        "unknown session, no token": _send(http, route, "0123456789abcdef", None),
    }
    bodies = {name: _assert_error(r, 401, shape) for name, r in refusals.items()}
    assert all(body == bodies["wrong"] for body in bodies.values()), bodies
    assert (_state(mine), _state(other)) == before
    assert mine.counts["requests"] == other.counts["requests"] == 1 and mine.reward == other.reward == 1.0
    assert _send(http, route, mine.id, mine.token).status_code == 200  # the right token still opens it


def test_no_route_lists_sessions(ep, http):
    sessions = [_session(ep), _session(ep)]
    for path in ("/sessions", "/sessions/", "/", f"/sessions/{sessions[0].id}", f"/sessions/{sessions[0].id}/",
                 f"/sessions/{sessions[0].id}/v1", "/docs", "/openapi.json", "/redoc"):
        for token in (None, sessions[0].token):
            headers = {"authorization": f"Bearer {token}"} if token else {}
            r = http.get(path, headers=headers)
            assert r.status_code in (404, 405), (path, r.status_code, r.text)
            assert not any(s.id in r.text for s in sessions), (path, r.text)
    r = http.post("/sessions", json={}, headers={"authorization": f"Bearer {sessions[0].token}"})
    assert r.status_code in (404, 405), r.text  # no admin route unless the standalone server adds it


# ----------------------------------------------------------------------------------------------- body caps
def _raw_exchange(url: str, head: str, body_parts: list[bytes], *, timeout: float = 10.0) -> tuple[int, bytes]:
    """Send ``head`` then ``body_parts`` on a raw socket (stopping quietly if the server closes first) and read the
    response until the server closes: its status and body."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        try:
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                headers, _, rest = data.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    headers, _, rest = data.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 "), data[:200]
    return int(headers.split()[1]), rest


def _head(session: Session, path: str, extra: str) -> str:
    return (f"POST /sessions/{session.id}{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {session.token}"
            f"\r\nContent-Type: application/json\r\nConnection: close\r\n{extra}\r\n")


@pytest.mark.parametrize("route", TURN_ROUTES)
def test_an_oversized_body_is_413_with_and_without_a_content_length(ep, http, route):
    session = _session(ep)
    shape, path = ROUTES[route][3], ROUTES[route][1]
    big = dict(ROUTES[route][2])
    key = "input" if route == "responses" else "messages"
    big[key] = [{"role": "user", "content": "x" * LIMIT}]
    payload = json.dumps(big).encode()
    # with a Content-Length
    error = _assert_error(_send(http, route, session.id, session.token, content=payload,
                                headers={"content-type": "application/json"}), 413, shape)
    assert error["type"] == "request_too_large" and str(LIMIT) in error["message"]
    # a Content-Length far over the cap and no body at all: refused on the header, the body never read
    status, body = _raw_exchange(ep.url, _head(session, path, f"Content-Length: {50 * 2**30}\r\n"), [])
    assert status == 413 and json.loads(body)
    # no Content-Length (chunked): refused once the bytes read pass the cap, the rest never sent
    chunks = [f"{len(payload[i:i + 1024]):x}\r\n".encode() + payload[i:i + 1024] + b"\r\n"
              for i in range(0, len(payload), 1024)]  # no last chunk: the body never ends
    status, body = _raw_exchange(ep.url, _head(session, path, "Transfer-Encoding: chunked\r\n"), chunks)
    assert status == 413 and json.loads(body)["error"]["type"] == "request_too_large"

    # httpx streaming a body with no length (a generator): the same 413
    def gen() -> Iterator[bytes]:
        for i in range(0, len(payload), 1024):
            yield payload[i:i + 1024]

    r = _send(http, route, session.id, session.token, content=gen(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    _assert_error(r, 413, shape)
    assert session.samples == [] and not session.counts
    # under the cap, the same route works
    assert _send(http, route, session.id, session.token).status_code == 200


# ------------------------------------------------------------------------------------------------- validation
BAD_BODIES: list[tuple[str, Any, str | None, str]] = [
    # (route, body: bytes as sent or a JSON value, the param it must name (None: no field), words in the message)
    ("chat", b"{not json", None, "not valid JSON"),
    ("chat", b"", None, "not valid JSON"),
    ("chat", b"\xff\xfe", None, "not valid JSON"),
    ("chat", [CHAT], None, "must be a JSON object"),
    ("chat", "hello", None, "must be a JSON object"),
    ("chat", {**CHAT, "modalities": ["audio"]}, "modalities[0]", "only the 'text' modality"),
    ("chat", {**CHAT, "messages": "What do the meters read?"}, "messages", "expected an array"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature", "expected a number"),
    ("chat", {**CHAT, "max_tokens": 1.5}, "max_tokens", "expected an integer"),
    ("chat", {**CHAT, "tools": {"read_meter": {}}}, "tools", "expected an array"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": 7}]}, "messages[0].content", "expected"),
    ("chat", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "unknown role"),
    ("chat", {**CHAT, "messages": []}, "messages", "must not be empty"),
    ("chat", {**CHAT, "n": 2}, "n", "only n=1"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens", "must be >= 1"),
    ("chat", b'{"model": "policy", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "temperature", "expected a number"),
    ("responses", b"{not json", None, "not valid JSON"),
    ("responses", 3, None, "must be a JSON object"),
    ("responses", {**RESPONSES, "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice.type", "hosted tool"),
    ("responses", {**RESPONSES, "input": 5}, "input", "expected"),
    ("responses", {**RESPONSES, "temperature": "hot"}, "temperature", "expected a number"),
    ("messages", b"{not json", None, "not valid JSON"),
    ("messages", None, None, "must be a JSON object"),
    ("messages", {**MESSAGES, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                  "tool_choice": {"type": "tool", "name": "web_search"}}, None, "tool_choice.name: 'web_search' is a server tool"),
    ("messages", {**MESSAGES, "messages": "What do the meters read?"}, None, "messages: expected an array"),
    ("messages", {**MESSAGES, "temperature": "hot"}, None, "temperature: expected a number"),
    ("messages", {**MESSAGES, "max_tokens": "64"}, None, "max_tokens: expected an integer"),
]


@pytest.mark.parametrize(("route", "body", "param", "words"), BAD_BODIES,
                         ids=[f"{r}-{i}" for i, (r, *_rest) in enumerate(BAD_BODIES)])
def test_a_bad_request_is_400_in_the_apis_shape_naming_the_field(ep, http, route, body, param, words):
    session = _session(ep)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = _send(http, route, session.id, session.token, content=content, headers={"content-type": "application/json"})
    error = _assert_error(r, 400, ROUTES[route][3])
    assert words in error["message"], error
    if ROUTES[route][3] == "openai":
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    else:
        assert error["type"] == "invalid_request_error"
    assert session.samples == [] and not session.counts


def test_the_clients_extra_fields_are_accepted_and_counted(ep):
    """A field the real SDKs let a caller add (``extra_body``, a beta header) changes nothing: 200, counted."""
    session = _session(ep)
    client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
    client.chat.completions.create(model="policy", messages=[USER], extra_body={"frobnicate": True})
    client.responses.create(model="policy", input="What do the meters read?", store=False,
                            extra_body={"client_metadata": {"x": "y"}})
    claude = anthropic.Anthropic(base_url=ep.anthropic_url(session), api_key=session.token, max_retries=0)
    claude.messages.create(model="policy", max_tokens=64, messages=[USER],
                           extra_body={"context_management": {"edits": []}},
                           extra_headers={"anthropic-beta": "context-management-2025-06-27"})
    count = claude.messages.count_tokens(model="policy", messages=[USER], system="Read meters.")
    assert count.input_tokens == len(session.chat.prompt_ids(
        [{"role": "system", "content": "Read meters."}, {"role": "user", "content": USER["content"]}], tools=None))
    assert session.ignored == {"frobnicate": 1, "client_metadata": 1, "store": 1, "context_management": 1,
                               "anthropic-beta": 1}


def test_too_many_messages_is_400_and_too_many_forks_is_429(ep, http):
    session = _session(ep, max_messages=8, max_samples=2)
    turns = [{"role": "user", "content": f"meters {i}?"} if i % 2 == 0 else {"role": "assistant", "content": "47"}
             for i in range(9)]
    error = _assert_error(_send(http, "chat", session.id, session.token, body={**CHAT, "messages": turns}), 400,
                          "openai")
    assert error["param"] == "messages" and "9 messages" in error["message"] and "8" in error["message"]
    assert session.samples == [] and session.counts["requests"] == 0
    assert _send(http, "chat", session.id, session.token, body={**CHAT, "messages": turns[1:]}).status_code == 200
    assert _send(http, "chat", session.id, session.token, body={**CHAT, "messages": turns[1:]}).status_code == 200
    error = _assert_error(_send(http, "chat", session.id, session.token, body={**CHAT, "messages": turns[1:]}), 429,
                          "openai")
    assert error["type"] == "rate_limit_error"
    assert dict(session.forks) == {"start": 1, "retried": 1} and len(session.samples) == 2


DEEP = b"[" * 4000 + b"]" * 4000
"""Valid JSON under the body cap, nested past the decoder's recursion limit."""


@pytest.mark.parametrize("route", ["chat", "messages", "reward"])
def test_a_deeply_nested_body_is_400(ep, http, route):
    session = _session(ep)
    r = _send(http, route, session.id, session.token, content=DEEP, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:200])
    _assert_error(r, 400, ROUTES[route][3])


def test_an_unexpected_error_on_the_samples_route_is_api_shaped(ep, http, monkeypatch):
    session = _session(ep)

    def broken() -> dict:
        raise RuntimeError("a bug")

    monkeypatch.setattr(session, "summary", broken)
    r = http.get(f"/sessions/{session.id}/samples", headers={"Authorization": f"Bearer {session.token}"})
    error = _assert_error(r, 500, "openai")
    assert "a bug" not in error["message"]  # the type only: internals stay in the log


def test_a_deeply_nested_body_does_not_take_the_server_down(ep, http):
    session = _session(ep)
    for route in ("chat", "messages", "reward"):
        r = _send(http, route, session.id, session.token, content=DEEP, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 600
    assert _send(http, "chat", session.id, session.token).status_code == 200
    assert session.reward is None and session.counts["requests"] == 1


TOOL_CHOICE_UNKNOWN = {
    "chat": {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "format_disk"}}},
    "responses": {**RESPONSES, "tools": [{"type": "function", "name": "read_meter", "parameters": {}}],
                  "tool_choice": {"type": "function", "name": "format_disk"}},
    "messages": {**MESSAGES, "tools": [{"name": "read_meter", "input_schema": {"type": "object"}}],
                 "tool_choice": {"type": "tool", "name": "format_disk"}},
}


@pytest.mark.parametrize("route", TURN_ROUTES)
def test_a_tool_choice_naming_an_unoffered_tool_is_400(ep, http, route):
    session = _session(ep)
    r = _send(http, route, session.id, session.token, body=TOOL_CHOICE_UNKNOWN[route])
    error = _assert_error(r, 400, ROUTES[route][3])
    assert "format_disk" in error["message"]
    assert session.samples == []


# ------------------------------------------------------------------------------------------- the model's calls
@pytest.mark.parametrize("turn", ["<tool_call>{not json</tool_call>",
                                  "I will format it.\n" + call("format_disk", drive="C")],
                         ids=["malformed", "unoffered_tool"])
def test_a_models_bad_tool_call_comes_back_as_text(ep, turn):
    session = _session(ep, [turn])
    client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
    completion = client.chat.completions.create(model="policy", messages=[USER], tools=TOOLS)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == turn
    assert session.counts["malformed_calls"] == 1 and session.samples[0].malformed_calls == 1
    # the client sends the text back: an extension, not a fork
    history = [USER, choice.message.model_dump(exclude_none=True), {"role": "user", "content": "Try again."}]
    assert client.chat.completions.create(model="policy", messages=history, tools=TOOLS).choices[0].message.content
    assert dict(session.forks) == {"start": 1} and session.samples[0].turns == 2


# ---------------------------------------------------------------------------------------------- abusive clients
LONG = "The meters read " + ", ".join(f"{i} kWh" for i in range(120)) + "."
STREAM_BODIES = {"chat": {**CHAT, "stream": True, "logprobs": True},
                 "responses": {**RESPONSES, "stream": True, "include": ["message.output_text.logprobs"]},
                 "messages": {**MESSAGES, "max_tokens": 1000, "stream": True}}


@pytest.mark.parametrize("route", TURN_ROUTES)
def test_a_client_dropping_a_stream_leaves_the_server_serving(ep, http, route):
    session = _session(ep, [LONG])
    method, path, _, _ = ROUTES[route]
    headers = {"authorization": f"Bearer {session.token}"}
    with httpx.Client(base_url=ep.url, timeout=10) as dropper:
        with dropper.stream(method, f"/sessions/{session.id}{path}", json=STREAM_BODIES[route],
                            headers=headers) as r:
            assert r.status_code == 200
            first = next(r.iter_raw(256))
            assert first.startswith((b"data: ", b"event: "))
    # the session holds the sampled turn; a following request (a retry: the client never saw the turn) is served
    assert session.samples[0].turns == 1 and session.samples[0].finish_reason == "stop"
    r = _send(http, route, session.id, session.token)
    assert r.status_code == 200, r.text
    assert dict(session.forks) == {"start": 1, "retried": 1}


def test_a_body_that_never_comes_does_not_block_other_requests(ep, http):
    session = _session(ep)
    parts = urlsplit(ep.url)
    stalled = []
    for _ in range(3):  # headers promise a body that never arrives
        sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
        sock.sendall(_head(session, "/v1/chat/completions", "Content-Length: 500\r\n").encode() + b'{"mod')
        stalled.append(sock)
    try:
        started = time.monotonic()
        assert _send(http, "chat", session.id, session.token).status_code == 200
        assert time.monotonic() - started < 5
    finally:
        for sock in stalled:
            sock.close()
    assert session.counts["requests"] == 1


def test_an_engine_failure_is_500_in_the_apis_shape_and_the_server_lives(ep, http):
    engine = scripted({"meters": ["47."]}, fail_on="explode")
    session = ep.open(engine)
    for route, shape in (("chat", "openai"), ("messages", "anthropic")):
        body = {**ROUTES[route][2], "messages": [{"role": "user", "content": "meters: explode"}]}
        error = _assert_error(_send(http, route, session.id, session.token, body=body), 500, shape)
        assert error["type"] == "api_error" and "RuntimeError" in error["message"]
        assert "explode" not in error["message"]  # the engine's message stays in the server's log
    assert session.samples == []
    assert _send(http, "chat", session.id, session.token).status_code == 200


# ---------------------------------------------------------------------------------------------- agent programs
ACCESS = SessionAccess(base_url="http://127.0.0.1:9/sessions/s/v1", anthropic_base_url="http://127.0.0.1:9/sessions/s",
                       api_key="k", session_id="s")


def _run(entry: Any = None, command: str | None = None, timeout_s: float = 5.0) -> ProgramOutcome:
    return asyncio.run(run_program(entry, command, ACCESS, {"prompt": "meters"}, timeout_s))


def test_a_hung_async_program_times_out():
    async def hang(base_url: str, api_key: str) -> float:
        await asyncio.sleep(3600)
        return 1.0

    started = time.monotonic()
    outcome = _run(hang, timeout_s=0.5)
    assert time.monotonic() - started < 5  # the hour-long program is cut at its timeout (slack for a loaded CI)
    assert outcome.timed_out and outcome.reward is None and outcome.error_type == "TimeoutError"
    assert "timeout_s=0.5" in outcome.error


def _gone(pid: int) -> bool:
    """The process has exited (a zombie no one reaps in this container counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_hung_command_times_out_and_its_process_group_is_killed(tmp_path):
    pids = tmp_path / "pids"
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-S', '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
            "time.sleep(60)\n")
    started = time.monotonic()
    outcome = _run(command=shlex.join([sys.executable, "-S", "-c", code]), timeout_s=3.0)  # time to write its pids
    assert time.monotonic() - started < 10
    assert outcome.timed_out and outcome.error_type == "TimeoutError"
    pid, child = map(int, pids.read_text().split())
    assert _gone(pid)
    deadline = time.monotonic() + 2
    while not _gone(child) and time.monotonic() < deadline:  # the grandchild: killed with the group
        time.sleep(0.05)
    assert _gone(child)


def test_a_program_that_raises_or_returns_junk_fails_its_sample_only():
    def boom(row: dict[str, Any]) -> float:
        raise ValueError(f"no meter in {row['prompt']!r}")

    outcome = _run(boom)
    assert outcome.error == "ValueError: no meter in 'meters'" and outcome.error_type == "ValueError"
    assert "ValueError" in outcome.traceback and not outcome.timed_out and outcome.reward is None
    outcome = _run(lambda: "great job")
    assert outcome.reward is None and "not a reward" in outcome.error and outcome.error_type == "BadReward"
    outcome = _run(lambda **kw: {"score": 1, "format": 0.5, "note": "fine"})
    assert (outcome.reward, outcome.parts, outcome.error) == (1.0, {"format": 0.5}, None)
    outcome = _run(command=shlex.join([sys.executable, "-S", "-c", "import sys; sys.exit(3)"]))
    assert outcome.reward is None and "exited 3" in outcome.error


# --------------------------------------------------------------------------------------------- binding, admin
def test_the_endpoint_binds_to_loopback_by_default(endpoint):
    assert endpoint.server.host == "127.0.0.1"
    assert endpoint.server._socket.getsockname()[0] == "127.0.0.1"
    server = EndpointServer(build_app(SessionRegistry()))
    try:
        assert server.host == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    finally:
        server.close()


def test_the_standalone_admin_route_opens_sessions_only_for_the_admin_token():
    from mcore_agentic.endpoint.serve import session_admin

    registry = SessionRegistry()
    counter = iter(range(100))

    def factory() -> Session:
        return Session(f"adm{next(counter)}", engine=scripted({"meters": ["47."]}),
                       chat=ChatTokenizer(qwen_tokenizer()), parser=get_tool_parser("hermes"), settings=SETTINGS)

    admin_token = "admin-" + "x" * 40
    server = EndpointServer(build_app(registry, admin=session_admin(registry, factory, admin_token, 2)))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                r = http.post("/sessions", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert len(registry) == 0
            admin = {"authorization": f"Bearer {admin_token}"}
            a, b = http.post("/sessions", headers=admin).json(), http.post("/sessions", headers=admin).json()
            assert http.post("/sessions", headers=admin).status_code == 429  # max_sessions
            assert a["session_id"] != b["session_id"] and a["api_key"] != b["api_key"]
            assert admin_token not in (a["api_key"], b["api_key"])
            assert a["base_url"] == f"{server.url}/sessions/{a['session_id']}/v1"
            client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0)
            assert client.chat.completions.create(model="policy", messages=[USER]).choices[0].message.content == "47."
            claude = anthropic.Anthropic(base_url=a["anthropic_base_url"], api_key=a["api_key"], max_retries=0)
            assert claude.messages.create(model="policy", max_tokens=64, messages=[
                USER, {"role": "assistant", "content": "47."}, {"role": "user", "content": "Sure?"}]).content
            # a's key opens no other session; the admin token opens none
            for token in (a["api_key"], admin_token):
                foreign = openai.OpenAI(base_url=b["base_url"], api_key=token, max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    foreign.chat.completions.create(model="policy", messages=[USER])
            assert http.get("/sessions", headers=admin).status_code in (404, 405)  # still no listing
            assert http.delete(f"/sessions/{b['session_id']}",
                               headers={"authorization": f"Bearer {a['api_key']}"}).status_code == 401
            assert http.delete(f"/sessions/{b['session_id']}",
                               headers={"authorization": f"Bearer {b['api_key']}"}).json()["deleted"] is True
            assert len(registry) == 1
            assert http.post("/sessions", headers=admin).status_code == 200  # room again
    finally:
        server.close()


