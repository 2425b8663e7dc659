"""A rollout rank's engine, watched for faults (separate placement): what a request's error cannot tell apart from the
engine dying.

A request whose ``generate`` raises fails alone (the agent loop records it); that is right for a bad request (a
prompt over the context, a malformed sampling setting: ``ValueError`` and the like) and wrong for an engine that
died (a crashed worker, a lost device, its process gone), which fails every request after it. :class:`GuardedEngine`
stands where the engine stands (every source holds it), notes the first such fault, and lets its owner swap in a
rebuilt engine (:meth:`replace`) without any source noticing. :class:`~.rollout_service.RolloutService` then
restores the step from its snapshot and generates it again (``rollout/engine_restarts``).
"""

from __future__ import annotations

import asyncio
from typing import Any

REQUEST_ERRORS = (ValueError, TypeError, KeyError, IndexError, asyncio.CancelledError)
"""What a request's own error raises; anything else from ``generate`` counts as the engine's fault."""


def is_engine_fault(exc: BaseException) -> bool:
    return isinstance(exc, Exception) and not isinstance(exc, REQUEST_ERRORS)


class GuardedEngine:
    """The engine behind a stable handle: ``generate`` notes engine faults; every other member is the engine's."""

    def __init__(self, engine: Any):
        self.inner = engine
        self.fault: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.inner.generate(*args, **kwargs)
        except BaseException as exc:
            if self.fault is None and is_engine_fault(exc):
                self.fault = exc
            raise

    def replace(self, engine: Any) -> Any:
        """Swap in a rebuilt engine; returns the old one (to shut down) and clears the fault."""
        old, self.inner, self.fault = self.inner, engine, None
        return old


__all__ = ["GuardedEngine", "REQUEST_ERRORS", "is_engine_fault"]
