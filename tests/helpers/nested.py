"""Changes to a nested dict named by ``__``-joined key paths, for tests that vary one field of a valid tree."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def apply_changes(tree: dict[str, Any], changes: Mapping[str, Any], *, delete: Any) -> dict[str, Any]:
    """``tree`` (changed in place) with each ``a__b__c=value`` of ``changes`` set at ``tree["a"]["b"]["c"]``; a
    value that ``is delete`` removes that key instead."""
    for dotted, value in changes.items():
        node = tree
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        if value is delete:
            del node[last]
        else:
            node[last] = value
    return tree
