"""Patch bookkeeping shared by every patch module: a named, revertible set of attribute swaps.

A :class:`Patch` knows its name, a one-line reason and how to install itself by
calling :meth:`PatchContext.swap` (``setattr`` that remembers the original).
A missing target (a module or symbol that moved in another megatron-core
version) is recorded in :attr:`PatchContext.missing`; :func:`megatron_patches.apply`
then undoes the patch and raises with the whole list: a patch that silently
does half its work is worse than none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

_MISSING = object()


@dataclass
class PatchContext:
    """Records every ``setattr`` a patch makes so :meth:`restore` can undo them exactly."""

    name: str
    swaps: list[tuple[Any, str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Targets this megatron-core version lacks (``module`` or ``module.attr``)."""

    def module(self, dotted: str) -> ModuleType | None:
        """Import ``dotted``, or record it as missing and return None."""
        try:
            return importlib.import_module(dotted)
        except Exception as exc:  # noqa: BLE001 - any import failure means the target is not there
            self.missing.append(f"{dotted} ({type(exc).__name__})")
            return None

    def swap(self, owner: Any, attr: str, new: Any) -> bool:
        """Replace ``owner.attr`` by ``new`` (remembering the original); False (recorded) if absent."""
        if owner is None or not hasattr(owner, attr):
            if owner is not None:
                self.missing.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}")
            return False
        self.swaps.append((owner, attr, owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, attr)))
        setattr(owner, attr, new)
        return True

    def swap_in(self, dotted: str, attr: str, make_new: Callable[[Any], Any]) -> bool:
        """``swap(module(dotted), attr, make_new(original))``; a missing module or attribute is recorded."""
        mod = self.module(dotted)
        if mod is None:
            return False
        if not hasattr(mod, attr):
            self.missing.append(f"{dotted}.{attr}")
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
