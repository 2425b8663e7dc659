"""What the endpoint's HTTP face (:mod:`.server`) needs of one client API: :class:`ChatApi`.

Each API module (:mod:`.openai_chat`, :mod:`.responses`, :mod:`.anthropic_messages`) ends with one ``API``
object built from its functions, and :data:`.server.APIS` registers them: :func:`.server.build_app` adds a route
for each registered API, so adding an API is one module that builds a :class:`ChatApi` and one entry there
(vLLM's entrypoints are the model: one serving object per API, routed by the app).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mcore_agentic.endpoint.turn import ApiError, TurnRequest, TurnResult


@dataclass(frozen=True)
class ChatApi:
    """One client API: the route its turns are posted to, its request -> :class:`~.turn.TurnRequest`, a
    :class:`~.turn.TurnResult` -> its response (whole or as server-sent event frames), and its error shape."""

    name: str
    """Names the API in the endpoint's log lines (a failure, a field ignored for the first time)."""
    path: str
    """The route, under a session's base ``/sessions/{session_id}``, a turn is posted to (e.g. ``/v1/messages``)."""
    known_fields: frozenset[str]
    """The top-level request fields the installed client defines (:func:`.field_policy.log_new` says whether an
    ignored field is one of them)."""
    parse_request: Callable[[Any], TurnRequest]
    """A request body -> the common form; :class:`~.turn.ApiError` (4xx, naming the field) if bad."""
    response_body: Callable[[TurnResult, TurnRequest], dict[str, Any]]
    """The whole response to a request that did not ask to stream."""
    stream_events: Callable[[TurnResult, TurnRequest], Iterator[str]]
    """The server-sent event frames (each a whole ``data: ...\\n\\n`` text) of a request that asked to stream."""
    error_body: Callable[[ApiError], dict[str, Any]]
    """The API's error object of an :class:`~.turn.ApiError` (answered with its HTTP status)."""
    count_tokens_path: str | None = None
    """A route, under the session's base, that answers ``{"input_tokens": n}``: the prompt tokens of the request's
    render (Anthropic's ``/v1/messages/count_tokens``); None: the API has none."""
    parse_count_request: Callable[[Any], TurnRequest] | None = None
    """The request body of :attr:`count_tokens_path` -> the common form (set with it)."""
    ignored_headers: tuple[str, ...] = ()
    """Request headers that change nothing here, counted among the request's ignored fields under their own name
    when sent (Anthropic's ``anthropic-beta``)."""

    def __post_init__(self) -> None:
        if (self.count_tokens_path is None) != (self.parse_count_request is None):
            raise ValueError(f"API {self.name!r}: count_tokens_path and parse_count_request go together")
