"""JSON-schema hygiene for tool schemas: null-valued keywords, as verl's pydantic dumps write them, dropped.

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
    """A copy of ``schema`` without null-valued keywords (see the module docstring); other values unchanged."""
    if isinstance(schema, dict):
        return {
            key: value if key in _INSTANCE_KEYWORDS else drop_null_keywords(value)
            for key, value in schema.items()
            if value is not None or key in _NULL_OK
        }
    if isinstance(schema, list):
        return [drop_null_keywords(item) for item in schema]
    return schema
