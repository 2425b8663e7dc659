"""Patch bookkeeping shared by every patch module: a named, revertible set of attribute swaps.

A :class:`Patch` knows its name, a one-line reason and how to install itself by
calling :meth:`PatchContext.swap` (``setattr`` that remembers the original).
Missing targets (a module or symbol that moved in another megatron-core
version) are skipped with a debug log, never an error, so the same patch set
works across the versions each module lists.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger("megatron_patches")

_MISSING = object()


@dataclass
class PatchContext:
    """Records every ``setattr`` a patch makes so :meth:`restore` can undo them exactly."""

    name: str
    swaps: list[tuple[Any, str, Any]] = field(default_factory=list)

    def module(self, dotted: str) -> ModuleType | None:
        """Import ``dotted`` or return None (debug log) when this megatron-core version lacks it."""
        try:
            return importlib.import_module(dotted)
        except Exception as exc:  # noqa: BLE001 - optional module: any import failure means "skip"
            logger.debug("patch %s: skip module %s (%s)", self.name, dotted, exc)
            return None

    def swap(self, owner: Any, attr: str, new: Any) -> bool:
        """Replace ``owner.attr`` by ``new`` (remembering the original); False if ``attr`` is absent."""
        if owner is None or not hasattr(owner, attr):
            logger.debug("patch %s: skip %r.%s (not present in this version)", self.name, owner, attr)
            return False
        self.swaps.append((owner, attr, owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, attr)))
        setattr(owner, attr, new)
        return True

    def swap_in(self, dotted: str, attr: str, make_new: Callable[[Any], Any]) -> bool:
        """``swap(module(dotted), attr, make_new(original))``, skipping silently if either is missing."""
        mod = self.module(dotted)
        if mod is None or not hasattr(mod, attr):
            logger.debug("patch %s: skip %s.%s (not present in this version)", self.name, dotted, attr)
            return False
        return self.swap(mod, attr, make_new(getattr(mod, attr)))

    def restore(self) -> None:
        """Undo every swap in reverse order."""
        for owner, attr, original in reversed(self.swaps):
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self.swaps.clear()


@dataclass(frozen=True)
class Patch:
    """One named patch: ``install(ctx)`` performs its swaps through ``ctx``."""

    name: str
    reason: str
    install: Callable[[PatchContext], None]
