"""A rollout rank's loop under separate placement (``rollout.placement=separate``): generate continuously, load new
weights between rounds, answer the trainer's requests.

The rank runs a colocated run's feed over a world of its own (its engine, tools, prompts and schedule: fresh or
partial rounds, the filter), drawing its engine's share of every prompt batch (the groups a colocated run's
rollout group ``k`` of ``E`` would draw, with the same seeds). One thread reads the ``down`` link
(:mod:`mcore_agentic.parallel.job`) into an inbox; the loop:

1. takes what arrived: a version's buckets are staged and loaded together when its ``WEIGHTS`` comes (the engine
   never samples from half a version); requests are noted;
2. answers a ``VALIDATE`` at once (greedy rollout of its share of the validation rows with the weights it holds);
3. answers the oldest ``WANT`` whose rows are ready (``ROWS``, :mod:`.wire`); on a dump step it keeps the rows
   (with their messages and tool I/O) until the trainer's values come back (``DUMP``), then writes the dump;
4. else generates the next step while ``step <= last wanted + rollout.max_staleness``: with 1, step ``s + 1``
   generates while the trainer trains step ``s`` (with the weights of step ``s``, so its tokens are one version
   old when trained). Under partial rollouts new weights load between its rounds, mid-step (the rounds' sessions
   go on from their exact ids; each token keeps the version that sampled it);
5. else waits for the next message.

A checkpoint's ``SAVE`` (and a resume's ``RESTORE``) is handled at the loop's next turn, never between two rounds of
a step: the rank writes its prompts' position, the steps it generated ahead of the trainer (with their rows'
objects) and its schedule's groups in flight into the trainer's checkpoint (``rollout_ranks/``), so a resumed run
answers each step with the rows the uninterrupted run trained.

An engine that dies during a step (:mod:`.engine_guard`) is rebuilt with the loaded weights and the step generated
again from its snapshot (``rollout/engine_restarts``); nothing of it is lost or trained twice.

Nothing here blocks the generation on the trainer: the weights arrive on the reading thread while rounds run. A
failure answers the trainer's next request with ``FAILED`` and the error line (the trainer stops with it).
"""

from __future__ import annotations

import logging
import pickle
import queue
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcore_agentic.feed import wire
from mcore_agentic.feed.feed import Feed
from mcore_agentic.feed.rounds import Rollout
from mcore_agentic.feed.scoring import rollout_stats
from mcore_agentic.rollout.engines.base import engine_shutdown
from mcore_agentic.utils.timing import timer

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3
"""Engine rebuilds one step may take before the run stops with the engine's error."""


class RolloutService:
    """One engine's rank serving the trainer (module docstring)."""

    def __init__(self, feed: Feed, links: Any, *, max_staleness: int, rebuild: Callable[[], Any] | None = None,
                 max_restarts: int = MAX_RESTARTS):
        self.feed = feed
        self.links = links
        self.max_staleness = max_staleness
        self.engine = feed.engine
        """A :class:`~.engine_guard.GuardedEngine` (build_feed's on a rollout rank), or the bare engine."""
        self.rebuild = rebuild
        """A fresh engine (its weights loaded here); None: an engine fault fails the run."""
        self.max_restarts = max_restarts
        self.current: tuple[int, list[Any]] | None = None
        """The loaded version and its buckets (host tensors): what a rebuilt engine loads."""
        self.restarts = 0
        self.idle_s = 0.0
        """Seconds the loop waited for the trainer (nothing to generate) since its last answer."""
        self.since = time.perf_counter()
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="rollout-link", daemon=True)
        self.staged: list[list[tuple[str, Any]]] = []
        self.wants: deque[tuple[int, int]] = deque()
        """(step, the trainer's version) asked for and not yet answered, oldest first."""
        self.validations: deque[int] = deque()
        self.checkpoints: deque[tuple[Any, ...]] = deque()
        self.ready: dict[int, Rollout] = {}
        self.dumping: dict[int, tuple[Any, int]] = {}
        """A dump step's rows (tagged, with their objects) and version, until the trainer's values come back."""
        self.next_step: int | None = None
        self.last_want: tuple[int, int] | None = None
        self.stopped = False
        self.updates = 0
        self.load_s = 0.0
        feed.roller.between_rounds = self.take_arrivals
        feed.roller.target_version = self.target_version

    # ------------------------------------------------------------------ the link
    def _read(self) -> None:
        """The reading thread: the ``down`` link into the inbox, until ``STOP`` (or the link fails)."""
        try:
            while True:
                head = wire.recv_header(self.links, 0, up=False)
                kind = head[0]
                if kind == wire.BUCKET:
                    self.inbox.put(("bucket", head[4], wire.recv_bucket(self.links, head)))
                elif kind == wire.DUMP:
                    self.inbox.put(("dump", head[1], wire.recv_returned(self.links, head)))
                elif kind in (wire.SAVE, wire.RESTORE):
                    self.inbox.put((kind, head[1], wire.recv_path(self.links, head)))
                elif kind == wire.STOP:
                    self.inbox.put(("stop",))
                    return
                else:
                    self.inbox.put((kind, head[1], head[2]))
        except Exception as exc:  # noqa: BLE001 -- the trainer is gone: stop serving
            self.inbox.put(("lost", repr(exc)))

    def take_arrivals(self, block: bool = False) -> None:
        """Handle what the reading thread queued (one message at least when ``block``)."""
        while True:
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            self._handle(item)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "bucket":
            self.staged.append(item[2])
        elif kind == wire.WEIGHTS:
            self._load(int(item[1]))
        elif kind == wire.WANT:
            step, version = int(item[1]), int(item[2])
            self.wants.append((step, version))
            self.last_want = (step, version)
            if self.next_step is None:
                self.next_step = step
        elif kind == wire.VALIDATE:
            self.validations.append(int(item[1]))
        elif kind in (wire.SAVE, wire.RESTORE):  # at the loop's next turn, never between two rounds of a step
            self.checkpoints.append(item)
        elif kind == "dump":  # a dump step's return trip: the trainer's values of the rows this rank sent
            rows, version = self.dumping.pop(int(item[1]))
            self.feed.dump([rows], "train", int(item[1]), version, item[2])
        elif kind == "stop":
            self.stopped = True
        elif kind == "lost":
            logger.error("rollout rank: the link to the trainer failed (%s); stopping", item[1])
            self.stopped = True

    def _load(self, version: int) -> None:
        """The staged buckets into the engine, then the version (between rounds: nothing is sampling)."""
        spent: dict[str, float] = {}
        with timer("load", spent):
            for bucket in self.staged:
                self.engine.update_weights(bucket, version=version)
            self.engine.finish_weight_update(version)
        self.current = (version, self.staged)
        self.staged = []
        self.updates += 1
        self.load_s += spent["load"]

    def target_version(self, step: int) -> int:
        """The version the trainer will hold when it trains ``step``: one update a step from the last it asked for."""
        if self.last_want is None:
            return int(self.engine.weight_version)
        asked, version = self.last_want
        return version + max(0, step - asked)

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        """Serve until the trainer says ``STOP``."""
        self.reader.start()
        while True:
            self.take_arrivals()
            if self.stopped:
                return
            in_hand: int | None = None  # the step of the request being answered, which a failure answers
            try:
                if self.checkpoints:
                    kind, in_hand, path = self.checkpoints.popleft()
                    self._checkpoint(kind, in_hand, path)
                elif self.validations:
                    in_hand = self.validations.popleft()
                    self._validate(in_hand)
                elif self.wants and self.wants[0][0] in self.ready:
                    in_hand = self.wants.popleft()[0]
                    self._answer(in_hand)
                elif self._may_generate():
                    step = self.next_step
                    assert step is not None
                    self.ready[step] = self.produce(step)
                    self.next_step = step + 1
                else:
                    waited = time.perf_counter()
                    self.take_arrivals(block=True)
                    self.idle_s += time.perf_counter() - waited
            except Exception as exc:  # noqa: BLE001 -- said to the trainer, which stops the run with it
                logger.error("rollout rank failed:\n%s", traceback.format_exc())
                self._fail(exc, in_hand)
                return

    def produce(self, step: int) -> Rollout:
        """``step``'s rollout; if the engine died during it, a rebuilt engine (with the loaded weights) generates the
        step again from where it began (its prompts' position and its schedule's groups in flight, restored), at most
        ``max_restarts`` times."""
        if self.rebuild is None or not hasattr(self.engine, "replace"):
            return self.feed.roll_out(step)
        fault: BaseException | None = None
        with tempfile.TemporaryDirectory(prefix="rollout_step_") as tmp:
            snapshot = self._snapshot(Path(tmp))
            for attempt in range(self.max_restarts + 1):
                rollout = self.feed.roll_out(step)
                fault = self.engine.fault
                if fault is None:
                    return rollout
                if attempt == self.max_restarts:
                    break
                logger.warning("rollout engine failed during step %d (%s: %s); rebuilding it and generating the step "
                               "again from its start", step, type(fault).__name__, fault)
                self._restart()
                self._restore(snapshot)
        raise RuntimeError(f"the rollout engine failed {self.max_restarts + 1} times in step {step}; last: "
                           f"{type(fault).__name__}: {fault}")

    def _snapshot(self, directory: Path) -> dict[str, Any]:
        writers, _ = self.feed.checkpoint_parts()
        for name, write in writers.items():
            (directory / name).mkdir()
            write(directory / name)
        return {"dir": directory, "loader": self.feed.loader_state()}

    def _restore(self, snapshot: dict[str, Any]) -> None:
        _, readers = self.feed.checkpoint_parts()
        for name, read in readers.items():
            read(snapshot["dir"] / name)
        self.feed.load_loader_state(snapshot["loader"])
        self.feed.start()

    def _restart(self) -> None:
        """A new engine in the guard, holding the loaded weights; the dead one shut down (best effort)."""
        assert self.rebuild is not None
        engine = self.rebuild()
        engine.resume_memory()
        if self.current is not None:
            version, buckets = self.current
            for bucket in buckets:
                engine.update_weights(bucket, version=version)
            engine.finish_weight_update(version)
        old = self.engine.replace(engine)
        try:
            engine_shutdown(old)
        except Exception as exc:  # noqa: BLE001 -- it is dead already
            logger.warning("shutting down the failed rollout engine: %r", exc)
        self.restarts += 1

    def _may_generate(self) -> bool:
        if self.current is None or self.next_step is None or self.last_want is None:
            return False
        return self.next_step <= self.last_want[0] + self.max_staleness and self.next_step not in self.ready

    def _answer(self, step: int) -> None:
        rollout = self.ready.pop(step)
        feed = self.feed
        p = feed.roller.placement
        rows = feed.tagged(rollout.rows, 0) if rollout.rows is not None else None
        stats = rollout_stats(rollout.generated, prefix_cache=rollout.prefix_cache)
        metrics = dict(rollout.metrics)
        metrics["rollout/streamed_groups"] = float(rollout.group_rows[p.group_index] // feed.settings.rollout.n)
        metrics["rollout/weight_loads"] = float(self.updates)
        metrics["rollout/engine_restarts"] = float(self.restarts)
        metrics["timing_s/rollout_weight_load"] = self.load_s
        now = time.perf_counter()
        metrics["rollout/idle_fraction"] = self.idle_s / max(now - self.since, 1e-9)
        self.updates, self.load_s, self.restarts, self.idle_s, self.since = 0, 0.0, 0, 0.0, now
        d = feed.settings.dumps
        if d is not None and rows is not None and step % d.freq == 0:
            self.dumping[step] = (rows, rollout.version)
        wire.send_reply(self.links, wire.ROWS, step, rows=rows, fields=feed.settings.fields,
                        routing_shape=feed.routing_shape, stats=stats, metrics=metrics)

    def _validate(self, step: int) -> None:
        val = self.feed.roll_out_validation(step)
        if val.scored:
            self.feed.report(val.scored, step, "val")
            if self.feed.dump_writer is not None:
                self.feed.dump(val.scored, "val", step, int(self.engine.weight_version))
        wire.send_reply(self.links, wire.VALIDATION, step, stats=rollout_stats(val.scored))

    def _checkpoint(self, kind: int, step: int, path: str) -> None:
        """SAVE: this rank's part of the trainer's checkpoint under ``path`` (its prompts' position, the steps it
        generated ahead and has not answered, its schedule's groups in flight, where its generation stands);
        RESTORE: read it back, so the resumed run answers what the uninterrupted one would have."""
        directory = Path(path)
        k = self.feed.roller.placement.group_index
        state_file = directory / f"engine_{k:05d}.pkl"
        writers, readers = self.feed.checkpoint_parts()
        if kind == wire.SAVE:
            for name, write in writers.items():
                (directory / name).mkdir(parents=True, exist_ok=True)
                write(directory / name)
            state = {"loader": self.feed.loader_state(), "ready": self.ready, "next_step": self.next_step,
                     "last_want": self.last_want}
            state_file.write_bytes(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            state = pickle.loads(state_file.read_bytes())  # noqa: S301 -- the run's own checkpoint (manifested)
            for name, read in readers.items():
                read(directory / name)
            self.feed.load_loader_state(state["loader"])
            self.feed.start()
            self.ready, self.next_step, self.last_want = state["ready"], state["next_step"], state["last_want"]
        wire.send_reply(self.links, wire.SAVED, step)

    def _fail(self, exc: BaseException, step: int | None) -> None:
        """Answer the request in hand (``step``), else the trainer's next one, with the error, so the trainer stops
        with it instead of waiting."""
        line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        if step is None:
            while not (self.wants or self.validations or self.checkpoints or self.stopped):
                self.take_arrivals(block=True)
            if self.stopped:
                return
            step = (self.checkpoints[0][1] if self.checkpoints else self.validations[0] if self.validations
                    else self.wants[0][0])
        wire.send_reply(self.links, wire.FAILED, step, error=line)


__all__ = ["RolloutService"]
