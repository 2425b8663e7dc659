"""The endpoint's API registry: every registered API is a :class:`~mcore_agentic.endpoint.api.ChatApi`, its routes are
served by :func:`~mcore_agentic.endpoint.server.build_app`'s app in its own error shape, and an API registered
afterwards (a toy that echoes) gets its route on the next app built — whole, streamed and refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from mcore_agentic.endpoint import anthropic_messages, openai_chat, responses
from mcore_agentic.endpoint.api import ChatApi
from mcore_agentic.endpoint.server import APIS, SessionRegistry, build_app
from mcore_agentic.endpoint.turn import ApiError, TurnRequest, TurnResult

BASE = "/sessions/s1"
TOKEN = "tok"
UNAUTHORISED = ApiError(401, "invalid API key for this session", type="authentication_error", code="invalid_api_key")


class FakeSession:
    """What the server asks of a session: its id and token, a turn, a token count."""

    id = "s1"
    token = TOKEN

    async def complete(self, request: TurnRequest, *, disconnected: Any = None) -> TurnResult:
        text = request.messages[-1]["content"]
        return TurnResult(content=text, reasoning=None, tool_calls=[], finish_reason="stop", prompt_tokens=1,
                          completion_tokens=len(text), model=request.model)

    def count_tokens(self, request: TurnRequest) -> int:
        return len(request.messages)


def _not_json(body: bytes) -> str:
    """The server's message for a body that is not JSON."""
    try:
        json.loads(body)
    except ValueError as exc:
        return f"the body is not valid JSON: {exc}"
    raise AssertionError(body)


def _client() -> TestClient:
    registry = SessionRegistry()
    registry.add(FakeSession())  # type: ignore[arg-type]
    return TestClient(build_app(registry))


def _paths(api: ChatApi) -> list[str]:
    return [api.path] + ([api.count_tokens_path] if api.count_tokens_path is not None else [])


def test_every_registered_api_is_a_chat_api():
    assert list(APIS.values()) == [openai_chat.API, responses.API, anthropic_messages.API]
    paths = [p for api in APIS.values() for p in _paths(api)]
    assert len(paths) == len(set(paths)), paths
    for name, api in APIS.items():
        assert isinstance(api, ChatApi) and api.name == name
        assert api.path.startswith("/v1/")
        for member in (api.parse_request, api.response_body, api.stream_events, api.error_body):
            assert callable(member)
        # the log lines name the API as they did when the server passed modules around
        assert api.parse_request.__module__.rsplit(".", 1)[-1] == name
    assert APIS["anthropic_messages"].count_tokens_path == "/v1/messages/count_tokens"
    assert APIS["anthropic_messages"].ignored_headers == ("anthropic-beta",)


def test_a_count_route_needs_its_parser():
    with pytest.raises(ValueError, match="go together"):
        ChatApi(name="x", path="/v1/x", known_fields=frozenset(), parse_request=openai_chat.parse_request,
                response_body=openai_chat.response_body, stream_events=openai_chat.stream_events,
                error_body=openai_chat.error_body, count_tokens_path="/v1/x/count")


@pytest.mark.parametrize("name", list(APIS))
def test_every_registered_route_is_served_in_its_apis_error_shape(name):
    api = APIS[name]
    client = _client()
    for path in _paths(api):
        response = client.post(f"{BASE}{path}", json={}, headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json() == api.error_body(UNAUTHORISED), path
        bad = client.post(f"{BASE}{path}", content=b"{", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bad.status_code == 400 and bad.json() == api.error_body(ApiError(400, _not_json(b"{"))), path


# ----------------------------------------------------------------------------------------------------------------
# A toy API registered by a test


def _echo_request(body: Any) -> TurnRequest:
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise ApiError(400, "text must be a string", param="text")
    return TurnRequest(messages=[{"role": "user", "content": body["text"]}], stream=body.get("stream") is True,
                       model="echo-model", ignored=tuple(sorted(set(body) - {"text", "stream"})))


def _echo_events(result: TurnResult, request: TurnRequest) -> Iterator[str]:
    for char in result.content:
        yield f"data: {char}\n\n"
    yield "data: [END]\n\n"


ECHO = ChatApi(
    name="echo", path="/v1/echo", known_fields=frozenset({"text", "stream"}), parse_request=_echo_request,
    response_body=lambda result, request: {"echo": result.content, "model": result.model},
    stream_events=_echo_events, error_body=lambda error: {"echo_error": error.message, "status": error.status},
)


@pytest.fixture
def echo_api() -> Iterator[ChatApi]:
    APIS[ECHO.name] = ECHO
    try:
        yield ECHO
    finally:
        del APIS[ECHO.name]


def test_a_registered_api_gets_its_route(echo_api):
    client = _client()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    whole = client.post(f"{BASE}/v1/echo", json={"text": "hello"}, headers=auth)
    assert whole.status_code == 200 and whole.json() == {"echo": "hello", "model": "echo-model"}
    streamed = client.post(f"{BASE}/v1/echo", json={"text": "hi", "stream": True}, headers=auth)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text == "data: h\n\ndata: i\n\ndata: [END]\n\n"
    refused = client.post(f"{BASE}/v1/echo", json={"text": 1}, headers=auth)
    assert refused.status_code == 400 and refused.json() == {"echo_error": "text must be a string", "status": 400}
    wrong = client.post(f"{BASE}/v1/echo", json={"text": "x"}, headers={"x-api-key": "wrong"})
    assert wrong.status_code == 401 and wrong.json() == ECHO.error_body(UNAUTHORISED)
    # the built-in APIs are still served beside it
    chat = client.post(f"{BASE}/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": "yo"}]}, headers=auth)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "yo"


def test_an_unregistered_api_has_no_route():
    assert "echo" not in APIS
    response = _client().post(f"{BASE}/v1/echo", json={"text": "hello"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 404
