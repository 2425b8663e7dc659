"""The common form every API's request and response is translated into, and the API-shaped error.

Each API module (:mod:`.openai_chat`, :mod:`.responses`, :mod:`.anthropic_messages`) parses its request body
into a :class:`TurnRequest` and renders a :class:`TurnResult` back in its own shape, whole or as server-sent
events. The session (:mod:`.session`) sees only these two types.

Messages in a :class:`TurnRequest` are in the OpenAI chat form, whatever the API:

* ``{"role": "system" | "user", "content": str}``;
* ``{"role": "assistant", "content": str, "tool_calls": [{"id", "type": "function", "function": {"name",
  "arguments": str}}], "reasoning_content": str}`` (``tool_calls`` and ``reasoning_content`` only when present);
* ``{"role": "tool", "tool_call_id": str, "content": str}``.

Content parts (text blocks) are joined into one string; a ``developer`` message is a ``system`` one.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

TurnFinish = Literal["stop", "length", "tool_calls", "stop_sequence"]


class ApiError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and one line, rendered in the calling API's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


@dataclass(frozen=True)
class TurnRequest:
    """One generation request, in the common form (module docstring)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``."""
    tool_choice: str = "auto"
    """``auto``, ``none``, ``required``, or the name of one tool. Only ``none`` changes what the endpoint does (calls
    are not parsed); the model is never constrained, so the others return what it sampled."""
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    """Chat Completions: ``stream_options.include_usage`` (a last chunk with the usage before ``[DONE]``)."""
    model: str = ""
    instructions: str | None = None
    """Responses API: the system text of this request only (not carried over by ``previous_response_id``)."""
    previous_response_id: str | None = None
    """Responses API: continue from this response's conversation (within the same session)."""
    freeform_tools: frozenset[str] = frozenset()
    """Responses API: the custom (freeform) tools among ``tools``, by name. Each is offered to the template as a
    function of one string argument ``input`` and returned as a ``custom_tool_call`` with that string."""
    reasoning_passback: bool = False
    """Responses API: ``include`` asks for ``reasoning.encrypted_content`` (a client that keeps no server state
    sends the reasoning back in it: here it holds the reasoning text, so the next request extends the sample)."""
    ignored: tuple[str, ...] = ()
    """The fields the request carried that change nothing here (:mod:`.field_policy`): counted, never refused."""


@dataclass(frozen=True)
class ToolCallOut:
    """A parsed tool call as the client receives it; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]


@dataclass
class TurnResult:
    """What one request sampled, in the common form."""

    content: str
    """The visible text: reasoning and the parsed tool calls removed (malformed calls stay, as the model wrote them)."""
    reasoning: str | None
    """The thinking text of a thinking template (``<think>...</think>``), None when the turn has none."""
    tool_calls: list[ToolCallOut]
    finish_reason: TurnFinish
    prompt_tokens: int
    completion_tokens: int
    model: str
    stop_sequence: str | None = None
    """The stop string that ended the turn (``finish_reason == "stop_sequence"``)."""
    logprobs: list[TokenLogprob] | None = None
    """One per sampled token when the request asked for log-probs."""
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
