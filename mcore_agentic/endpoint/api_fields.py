"""What the three API modules share: strict field readers that raise :class:`~.turn.ApiError` naming the field
path, the known-field sets taken from the installed clients (known or not, a field the endpoint does not read is
accepted: :mod:`.field_policy`), content-part joining, and SSE framing.

A field path is written as a client would find it in its own request: ``messages[2].content[0]``,
``stream_options.include_usage``. Every refusal is a 400 whose ``param`` is that path and whose message starts with
it, so one line says what to fix. JSON type names (``string``, ``integer``, ``object``...) are used in messages, as
the client wrote JSON, not Python.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

from mcore_agentic.endpoint.turn import ApiError
from mcore_agentic.rollout.tool_call import json_type  # the JSON names of types, for messages

TEXT_JOIN = "\n"
"""Separator between the text parts of one content list (as vLLM joins them); one part stays as it is."""

DELTA_CHARS = 16
"""Most characters in one streamed text delta."""

_MISSING = object()


def bad(path: str, message: str, *, status: int = 400) -> ApiError:
    """The refusal of the field at ``path``: ``<path>: <message>``, ``param=path``."""
    return ApiError(status, f"{path}: {message}" if path else message, param=path or None)


def expected(path: str, what: str, value: Any) -> ApiError:
    return bad(path, f"expected {what}, got {json_type(value)}")


def join_path(base: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{base}[{key}]"
    return f"{base}.{key}" if base else key


# ----------------------------------------------------------------------------------------------------------------
# Known fields


def client_fields(*typed_dicts: type) -> frozenset[str]:
    """Every key of the given client ``TypedDict`` request classes (their bases' keys included)."""
    keys: set[str] = set()
    for cls in typed_dicts:
        keys |= set(getattr(cls, "__required_keys__", ())) | set(getattr(cls, "__optional_keys__", ()))
        for base in cls.__mro__:
            keys |= set(getattr(base, "__annotations__", {}))
    return frozenset(keys)


def body_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_type(body)}")
    return body


# ----------------------------------------------------------------------------------------------------------------
# Strict readers: ``obj[key]`` checked; absent or null gives ``default`` unless ``required``


def _get(obj: dict[str, Any], key: str, path: str, required: bool) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise bad(join_path(path, key), "is required" if value is _MISSING else "must not be null")
        return _MISSING
    return value


def get_str(obj: dict[str, Any], key: str, path: str = "", *, required: bool = False,
            default: str | None = None) -> str | None:
    value = _get(obj, key, path, required)
    if value is _MISSING:
        return default
    if not isinstance(value, str):
        raise expected(join_path(path, key), "a string", value)
    return value


def get_bool(obj: dict[str, Any], key: str, path: str = "", *, default: bool) -> bool:
    value = _get(obj, key, path, False)
    if value is _MISSING:
        return default
    if not isinstance(value, bool):
        raise expected(join_path(path, key), "a boolean", value)
    return value


def get_int(obj: dict[str, Any], key: str, path: str = "", *, required: bool = False, minimum: int | None = None,
            maximum: int | None = None) -> int | None:
    value = _get(obj, key, path, required)
    if value is _MISSING:
        return None
    where = join_path(path, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise expected(where, "an integer", value)
    if minimum is not None and value < minimum:
        raise bad(where, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise bad(where, f"must be <= {maximum}, got {value}")
    return value


def get_number(obj: dict[str, Any], key: str, path: str = "", *, low: float, high: float,
               low_open: bool = False) -> float | None:
    """A number in ``[low, high]`` (``(low, high]`` when ``low_open``); None when absent or null."""
    value = _get(obj, key, path, False)
    if value is _MISSING:
        return None
    where = join_path(path, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise expected(where, "a number", value)
    if value < low or (low_open and value == low) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad(where, f"must be in {interval}, got {value:g}")
    return float(value)


def get_list(obj: dict[str, Any], key: str, path: str = "", *, required: bool = False) -> list[Any] | None:
    value = _get(obj, key, path, required)
    if value is _MISSING:
        return None
    if not isinstance(value, list):
        raise expected(join_path(path, key), "an array", value)
    return value


def get_dict(obj: dict[str, Any], key: str, path: str = "", *, required: bool = False) -> dict[str, Any] | None:
    value = _get(obj, key, path, required)
    if value is _MISSING:
        return None
    if not isinstance(value, dict):
        raise expected(join_path(path, key), "an object", value)
    return value


def as_dict(value: Any, path: str, what: str = "an object") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise expected(path, what, value)
    return value


def refuse_unless_null(body: dict[str, Any], key: str, why: str) -> None:
    """400 when ``key`` is given a value: a field that would change results in a way this endpoint cannot honour."""
    if body.get(key) is not None:
        raise bad(key, why)


# ----------------------------------------------------------------------------------------------------------------
# Content


def join_text_parts(content: Any, path: str, *, text_types: Iterable[str], drop_types: Iterable[str] = (),
                    text_key: str = "text", what: str = "a string or a list of content parts",
                    allow_null: bool = True) -> str:
    """``content`` as one string: a string as it is, null as ``""``, a list of parts with the text of the parts
    whose ``type`` is in ``text_types`` joined by :data:`TEXT_JOIN` (``drop_types`` skipped). Any other part type:
    400 ``only text content is supported`` naming the part."""
    if isinstance(content, str):
        return content
    if content is None and allow_null:
        return ""
    if not isinstance(content, list):
        raise expected(path, what, content)
    text_types, drop_types = frozenset(text_types), frozenset(drop_types)
    texts = []
    for i, part in enumerate(content):
        where = join_path(path, i)
        part = as_dict(part, where, "a content part object")
        kind = get_str(part, "type", where, required=True)
        if kind in drop_types:
            continue
        if kind not in text_types:
            raise bad(where, f"only text content is supported, got a '{kind}' part")
        texts.append(get_str(part, text_key, where, required=True))
    return TEXT_JOIN.join(texts)


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool in the common form; ``description`` and ``parameters`` only when the client gave them."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A ``tool_calls`` entry of a common-form assistant message."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(content: str, tool_calls: list[dict[str, Any]], reasoning: str | None) -> dict[str, Any]:
    """A common-form assistant message: ``tool_calls`` and ``reasoning_content`` only when present."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


# ----------------------------------------------------------------------------------------------------------------
# Streaming


def pieces(text: str, size: int = DELTA_CHARS) -> Iterator[str]:
    """``text`` cut into consecutive pieces of at most ``size`` characters (none for ``""``)."""
    for start in range(0, len(text), size):
        yield text[start:start + size]


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent-event frame: ``event: <event>`` (when given) and ``data: <json>``, blank-line terminated."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {dumps(data)}\n\n"
