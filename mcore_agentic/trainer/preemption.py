"""Graceful stop on a signal: finish the step, agree across ranks, checkpoint, exit with :data:`EXIT_PREEMPTED`.

Slurm sends ``SIGTERM`` before it preempts a job (and ``--signal`` asks it for an
earlier warning such as ``SIGUSR1`` before the time limit); Kubernetes and
``torchrun`` send ``SIGTERM``. :class:`StopSignals` turns the signals named in
``trainer.stop_signals`` into a request that the step loop acts on at its next
step boundary:

* the first signal only sets a flag: the current step (rollout and update are
  one unit: an update needs the whole rollout, and a half-rolled-out step has
  nothing worth keeping) runs to its end;
* at each step boundary :meth:`StopSignals.poll` all-reduces the flags (and
  rank 0's time-based save clock) so every rank takes the same decision, even
  when only some of them were signalled;
* the trainer then saves a checkpoint, every rank exits with ``75`` (sysexits'
  ``EX_TEMPFAIL``: stopped early with a checkpoint, run the same command to
  resume), and ``launch/pretrain_rl.py`` prints one line saying so;
* a *second* signal exits at once (code ``128 + signum``), even while the main
  thread is blocked inside a collective: the watcher thread reads Python's
  signal wakeup fd, which the C-level handler writes whatever the main thread is
  doing. ``atexit`` does not run then, so the code tool's sandboxes get up to
  :data:`HARD_EXIT_CLEANUP_S` to kill their executions and remove their host-side
  state (what they cannot, the next trainer on the host reclaims). Deliveries within :data:`REPEAT_WINDOW_S` of the first count as the same
  signal: under Slurm every process of the step receives it and ``torchrun``
  forwards it once more to its workers.

The SFT warm start is one phase: a signal during it takes effect when it ends
(then the warm start is saved as ``global_step_0``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
"""Exit code of every rank after a signal-triggered checkpoint (``EX_TEMPFAIL``: resume by running it again)."""
REPEAT_WINDOW_S = 3.0
"""Deliveries of a stop signal this close to the first are the same event (Slurm + torchrun both deliver)."""


HARD_EXIT_CLEANUP_S = 2.0
"""How long an immediate exit waits for the code sandboxes to kill their executions and remove their host state."""


def _release_host_state() -> None:
    """Before an immediate exit (no ``atexit``): the code sandboxes' host-side state, if this process has any.

    Runs on a helper thread, bounded by :data:`HARD_EXIT_CLEANUP_S`, so an exit requested from a signal
    handler cannot wait on a lock the interrupted main thread holds; what it cannot finish, the next
    trainer on the host reclaims (the state is named after its owner process).
    """
    sandbox = sys.modules.get("mcore_agentic.tools.sandbox")
    if sandbox is None:
        return
    cleaner = threading.Thread(target=sandbox.close_all, name="sandbox-cleanup", daemon=True)
    cleaner.start()
    cleaner.join(HARD_EXIT_CLEANUP_S)


class TrainingStopped(Exception):
    """Raised by the step loop after the checkpoint of a signal-triggered stop (identical on every rank)."""

    def __init__(self, step: int, signal_name: str, checkpoint: str | None, resume: str = "run the same command"):
        self.step = step
        self.signal_name = signal_name
        self.checkpoint = checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no new checkpoint (nothing trained since the last one)"
        super().__init__(
            f"stopped on {signal_name} after step {step}: {where}; {resume} to resume (exit code {EXIT_PREEMPTED})"
        )


def parse_signals(names: Sequence[str]) -> list[signal.Signals]:
    """``["SIGTERM", "USR1", "10"]`` -> signals; an unknown name is a ValueError naming it."""
    out = []
    for name in names:
        text = str(name).strip().upper()
        try:
            sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
        except (KeyError, ValueError):
            raise ValueError(f"{name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be caught")
        out.append(sig)
    return out


class StopSignals:
    """Turns stop signals into a flag polled at step boundaries; a repeated signal exits at once.

    Use as a context manager around the step loop (main thread only; elsewhere it is a
    no-op that never requests a stop). :meth:`poll` is collective when ``torch.distributed``
    is initialised.
    """

    def __init__(self, signals: Sequence[str | int], *, save_every_minutes: float | None = None,
                 repeat_window_s: float = REPEAT_WINDOW_S):
        self.signals = parse_signals([str(s) for s in signals])
        self.save_every_s = save_every_minutes * 60.0 if save_every_minutes else None
        self.repeat_window_s = repeat_window_s
        self.received: signal.Signals | None = None
        self._first_at = 0.0
        self._fd_ours = False
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_fd: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None
        self._last_save = time.monotonic()

    # --------------------------------------------------------------------------- install
    def __enter__(self) -> StopSignals:
        if not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            logger.warning("stop signals not installed: not on the main thread")
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._fd_ours = True
        self._watcher = threading.Thread(target=self._watch, name="stop-signals", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pipe is None:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if self._armed():
            signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        self._fd_ours = False
        r, w = self._pipe
        self._pipe = None
        os.close(w)  # the watcher's read returns b"" and it ends
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        os.close(r)

    def _armed(self) -> bool:
        """Whether Python's wakeup fd is still ours (main thread only: it swaps the fd to read it)."""
        if self._pipe is None:
            return False
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(current, warn_on_full_buffer=False)
        return current == self._pipe[1]

    def rearm(self) -> None:
        """Take the wakeup fd back if someone replaced it (main thread; called at every poll).

        Nothing in the trainer replaces it (asyncio only does for ``add_signal_handler``); if
        something did, repeats are counted by the Python handler until this runs again.
        """
        if self._pipe is not None and threading.current_thread() is threading.main_thread():
            self._fd_ours = self._armed()
            if not self._fd_ours:
                signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
                self._fd_ours = True

    # --------------------------------------------------------------------------- delivery
    def _on_signal(self, signum: int, frame: Any) -> None:
        # Runs on the main thread between bytecodes, possibly re-entered by the next signal: no locks.
        # The watcher counts deliveries from the wakeup fd; this handler only counts when the fd is not ours.
        self._note(signum, count=not self._fd_ours)

    def _watch(self) -> None:
        assert self._pipe is not None
        r = self._pipe[0]
        ours = {int(s) for s in self.signals}
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in ours:
                    self._note(signum, count=True)

    def _note(self, signum: int, *, count: bool) -> None:
        """First delivery: the request. Later ones within the window: the same. Later still: exit now.

        Lock-free (the handler may re-enter on the main thread while the watcher runs): the first
        check-and-set can race between the two, which at worst prints the first line twice.
        """
        now = time.monotonic()
        if self.received is None:
            self._first_at = now
            self.received = signal.Signals(signum)
            _say(f"received {self.received.name}: finishing the current step, then saving a checkpoint and "
                 f"exiting ({self.received.name} again after {self.repeat_window_s:.0f} s exits at once)")
            return
        if not count or now - self._first_at < self.repeat_window_s:
            return
        _say(f"second {signal.Signals(signum).name}: exiting now without a checkpoint (the last complete one is kept)")
        _release_host_state()
        os._exit(128 + signum)

    # --------------------------------------------------------------------------- decisions
    @property
    def requested(self) -> bool:
        return self.received is not None

    def poll(self) -> tuple[bool, bool]:
        """``(stop, save_due)`` agreed by every rank: stop if any rank was signalled; save if rank 0's clock says so."""
        if not self.signals and self.save_every_s is None:
            return False, False  # nothing can ask for a stop or a save: no collective (the config is every rank's)
        import torch
        import torch.distributed as dist

        self.rearm()
        rank = dist.get_rank() if dist.is_initialized() else 0
        due = bool(self.save_every_s is not None and rank == 0 and time.monotonic() - self._last_save >= self.save_every_s)
        flags = [float(self.requested), float(due)]
        if dist.is_initialized():
            from mcore_agentic.parallel import comm

            # A host call: every rank may wait here for the slowest one's step (gloo: no spinning SMs).
            flags = comm.all_reduce_host(comm.to_host(flags, torch.float32), op=dist.ReduceOp.MAX).tolist()
        return bool(flags[0]), bool(flags[1])

    def saved(self) -> None:
        """Restart the time-based save clock (any checkpoint counts)."""
        self._last_save = time.monotonic()

    @property
    def signal_name(self) -> str:
        return self.received.name if self.received is not None else "a stop signal to another rank"


def _say(message: str) -> None:
    """One line on stderr, safe from a signal handler or a thread (no logging locks)."""
    rank = os.environ.get("RANK", "0")
    try:
        os.write(sys.stderr.fileno(), f"rank {rank}: {message}\n".encode())
    except OSError:
        pass


__all__ = ["EXIT_PREEMPTED", "REPEAT_WINDOW_S", "StopSignals", "TrainingStopped", "parse_signals"]
