"""A session's share of the rollout's rounds: when its requests may reach the engine, and how much they may sample.

An agent program runs on between the rollout's rounds (under partial rollouts, across training steps); the engine
does not (it sleeps while the trainer trains, and its weights change). So each session of a rollout source has a
:class:`RoundGate`: every engine call of the session first takes a turn from it, which waits while the gate is shut
(between rounds) or the round's turns or tokens for the session are spent; the call may then sample at most the
round's tokens left (the session continues a cut turn in a later round from its exact ids). The source grants each
round's budget (:meth:`RoundGate.grant`, from the trainer's thread) and shuts the gate when the round ends;
:meth:`RoundGate.end` wakes every waiter to fail (the session closed). Thread-safe: the waiters run on the endpoint's
event loop, the grants on the trainer's thread.
"""

from __future__ import annotations

import asyncio
import threading


class RoundClosed(Exception):
    """The session ended while its request waited for a round."""


class RoundGate:
    """When a session's engine calls may run (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self._turns: int | None = None
        self._tokens: int | None = None
        self._ended = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.waiting = 0
        """Calls waiting for a round now."""

    # -- the source's side (the trainer's thread) --------------------------------------------------------
    def grant(self, turns: int | None, tokens: int | None) -> None:
        """Open a round allowing ``turns`` engine calls and ``tokens`` sampled tokens (None: no limit)."""
        with self._lock:
            self._open, self._turns, self._tokens = True, turns, tokens
            self._wake()

    def shut(self) -> None:
        """The round is over: calls wait for the next one."""
        with self._lock:
            self._open = False

    def end(self) -> None:
        """The session ended: every waiting call (and every later one) raises :class:`RoundClosed`."""
        with self._lock:
            self._ended = True
            self._wake()

    @property
    def allows(self) -> bool:
        """Whether a call could run now (a waiter is about to)."""
        with self._lock:
            return self._allows()

    # -- the session's side (the endpoint's loop) --------------------------------------------------------
    async def take(self) -> int | None:
        """Wait until the round allows a call; it counts as a turn. The tokens it may sample (None: no limit)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._ended:
                    raise RoundClosed
                if self._allows():
                    if self._turns is not None:
                        self._turns -= 1
                    return self._tokens
                event = asyncio.Event()
                self._waiters.append((loop, event))
                self.waiting += 1
            try:
                await event.wait()
            finally:
                with self._lock:
                    self.waiting -= 1

    def spent(self, tokens: int) -> None:
        """A call sampled ``tokens``."""
        with self._lock:
            if self._tokens is not None:
                self._tokens = max(self._tokens - tokens, 0)

    # -- internals (lock held) ---------------------------------------------------------------------------
    def _allows(self) -> bool:
        return (self._open and not self._ended and (self._turns is None or self._turns > 0)
                and (self._tokens is None or self._tokens > 0))

    def _wake(self) -> None:
        for loop, event in self._waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is gone: nobody waits there any more
                pass
        self._waiters = []
