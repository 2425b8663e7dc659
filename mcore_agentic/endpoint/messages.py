"""Messages as the session compares and renders them: the template's form of a common-form message, the key a
client's echo of a message is compared by (arguments JSON re-serialised, ``content`` null vs ``""``, content parts,
reordered keys, whitespace around the model's text, extra fields and tool-call ids do not count), reasoning split off
a sampled turn, a turn cut at a client's stop string, and why a request that extends no sample forks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mcore_agentic.rollout.tokenization import ChatTokenizer


def renderable(message: dict[str, Any]) -> dict[str, Any]:
    """A common-form message as chat templates take it: tool-call arguments as objects (JSON text parsed)."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls", "tool_call_id",
                                                     "reasoning_content", "name")}
    if out.get("content") is None:
        out["content"] = ""
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": arguments_value(c["function"].get("arguments"))}}
                             for c in message["tool_calls"]]
    elif "tool_calls" in out:
        del out["tool_calls"]
    if not out.get("reasoning_content"):
        out.pop("reasoning_content", None)
    return out


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What of a message must stay the same for a request to extend a sample: the role, the text (the model's
    edge-stripped), the calls' names and parsed arguments (not their ids or JSON spelling), the reasoning."""
    role = message.get("role")
    content = message.get("content") or ""
    if role == "assistant":
        calls = tuple((c["function"]["name"], canonical_json(arguments_value(c["function"].get("arguments"))))
                      for c in message.get("tool_calls") or [])
        reasoning = (message.get("reasoning_content") or "").strip()
        return ("assistant", content.strip(), calls, reasoning)
    return (role, content)


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return canonical_json(tools or [])


def bare_id(response_id: str) -> str:
    """The session's id of a response from the id a client got (any of the three APIs' prefixes)."""
    for prefix in ("chatcmpl-", "resp_", "msg_"):
        if response_id.startswith(prefix):
            return response_id[len(prefix):]
    return response_id


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, visible)`` of a thinking template's turn: the text before ``</think>`` (without the opening
    tag) and what follows it; ``(None, text)`` when the turn has no ``</think>``."""
    end = text.find("</think>")
    if end < 0:
        return None, text
    head = text[:end]
    start = head.find("<think>")
    reasoning = head[start + len("<think>"):] if start >= 0 else head
    return reasoning.strip("\n"), text[end + len("</think>"):].lstrip("\n")


def mismatch_reason(keys: list[tuple[Any, ...]], echo: list[tuple[Any, ...]]) -> str:
    for a, b in zip(keys, echo):
        if a == b:
            continue
        if a[0] == b[0] == "assistant" and a[1:3] == b[1:3] and b[3] and not a[3]:
            return "thinking_dropped"
        return "rewritten"
    return "retried" if len(keys) <= len(echo) else "rewritten"


def cut_at_stop(chat: ChatTokenizer, ids: list[int], stops: Sequence[str]) -> tuple[list[int], str | None]:
    """The sampled ids up to the token that completes the first stop string (and that string), or all of them."""
    text = chat.decode(ids)
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return ids, None
    _pos, stop = min(found)
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds the stop string (monotone in the count)
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in chat.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo], stop


def arguments_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
