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

    def add(self, owner: Any, attr: str, value: Any) -> bool:
        """Define ``owner.attr`` (which must not exist); :meth:`restore` deletes it again."""
        if owner is None or hasattr(owner, attr):
            if owner is not None:
                self.missing.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{attr} (expected absent)")
            return False
        self.swaps.append((owner, attr, _MISSING))
        setattr(owner, attr, value)
        return True

    def swap_in(self, dotted: str, attr: str, make_new: Callable[[Any], Any]) -> bool:
        """``swap(module(dotted), attr, make_new(original))``; a missing module or attribute is recorded."""
        return self.wrap(self.module(dotted), attr, make_new)

    def attr(self, dotted: str, name: str) -> Any:
        """``module(dotted).name`` (a class, say), or None with the missing module or attribute recorded."""
        mod = self.module(dotted)
        if mod is None:
            return None
        if not hasattr(mod, name):
            self.missing.append(f"{dotted}.{name}")
            return None
        return getattr(mod, name)

    def wrap(self, owner: Any, attr: str, make_new: Callable[[Any], Any]) -> bool:
        """``swap(owner, attr, make_new(original))``; a missing attribute is recorded, a None owner skipped."""
        if owner is None or not hasattr(owner, attr):
            return self.swap(owner, attr, None)  # records what is missing
        return self.swap(owner, attr, make_new(getattr(owner, attr)))

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
    """One named patch: ``install(ctx)`` performs its swaps through ``ctx``.

    ``cpu_only``: the patch only stands in for CUDA (the default); :func:`megatron_patches.apply`
    skips it when CUDA is available. A patch that fixes a device-independent bug (the
    checkpoint-load ones) sets it False and is applied on GPU too.
    """

    name: str
    reason: str
    install: Callable[[PatchContext], None]
    cpu_only: bool = True
