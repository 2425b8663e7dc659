"""JSON-schema hygiene for tool schemas (null-valued keywords, as verl's pydantic dumps write them, dropped), and
the tools' schemas as a prompt shows them (:func:`openai_schemas`).

verl serialises ``OpenAIFunctionPropertySchema`` with every optional field, so its tool
schemas carry ``"enum": null``, ``"items": null`` or ``"description": null``. Null is
not a valid value for those keywords: ``jsonschema`` raises ``TypeError`` when it meets
one while validating arguments. An absent keyword is what such a dump means, so the
keyword is dropped, at every depth of the schema. ``const`` and ``default`` keep a null
value (it is data there: "must be null", "defaults to null"), and so do values inside
``enum``, ``examples`` and ``const`` (instances, not schemas).
"""

from __future__ import annotations

from typing import Any

_INSTANCE_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
_NULL_OK = frozenset({"const", "default"})


def drop_null_keywords(schema: Any) -> Any:
    """``schema`` without null-valued keywords (see the module docstring): the object itself when it has
    none, else a copy with them dropped; other values unchanged."""
    return _dropped(schema) if _has_null_keyword(schema) else schema


def _has_null_keyword(schema: Any) -> bool:
    if isinstance(schema, dict):
        return any(
            (value is None and key not in _NULL_OK) or (key not in _INSTANCE_KEYWORDS and _has_null_keyword(value))
            for key, value in schema.items()
        )
    if isinstance(schema, list):
        return any(_has_null_keyword(item) for item in schema)
    return False


def _dropped(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            key: value if key in _INSTANCE_KEYWORDS else _dropped(value)
            for key, value in schema.items()
            if value is not None or key in _NULL_OK
        }
    if isinstance(schema, list):
        return [_dropped(item) for item in schema]
    return schema


def openai_schemas(tools: Any) -> list[dict] | None:
    """The schemas a chat template renders for ``tools`` (a name -> tool mapping), in order; None without tools."""
    return [t.get_openai_tool_schema() for t in tools.values()] or None
