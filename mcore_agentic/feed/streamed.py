"""The trainer's side of separate placement (``rollout.placement=separate``): its steps' groups come from the rollout
ranks, and its weights go to them.

On the trainer's rank 0 (the only trainer rank on the links, :mod:`mcore_agentic.parallel.job`):

* :class:`LinkEngine` stands where a colocated run's engine stands in the sharding manager: each exported bucket is
  copied to the host and queued for every engine's rank, then the version (``WEIGHTS``); the :class:`Sender` thread
  sends them while the trainer goes on to its step (at most one version waits unsent). The rollout ranks load a
  version between two rounds of their generation, which goes on meanwhile.
* :class:`Remote` asks every engine for a step's rows (``WANT``) or a validation (``VALIDATE``) and receives the
  answers (:mod:`.wire`).

:class:`StreamedRounds` is the trainer's schedule: one round, in which rank 0 receives each engine's share of the
step's groups, already scored and tagged, as tensors; the feed's hand-off then deals them to the DP replicas as it
deals a colocated run's. The other trainer ranks hold nothing until the hand-off (the trainer's world is one
rollout group led by rank 0).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.data.batch import Batch
from mcore_agentic.feed import wire
from mcore_agentic.feed.distribute import unpack_rows
from mcore_agentic.feed.rounds import Rollout, RoundsResult, Rows
from mcore_agentic.parallel import comm
from mcore_agentic.parallel.job import RolloutRankFailed
from mcore_agentic.parallel.stats import Stats

logger = logging.getLogger(__name__)


class Sender:
    """The ``down`` link's one writer: a thread that sends what the trainer queues, in order, so a version's buckets
    cross the link while the trainer trains on (the overlap ``rollout.max_staleness`` allows). At most one version
    waits unsent: queuing the next waits for it. A failed send is raised at the next call."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.error: BaseException | None = None
        self.version_sent = threading.Event()
        self.version_sent.set()
        self.thread = threading.Thread(target=self._run, name="weights-link", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                if self.error is None:
                    job()
            except BaseException as exc:  # noqa: BLE001 -- raised on the trainer's thread at its next call
                self.error = exc
                self.version_sent.set()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"sending to the rollout ranks failed: {self.error!r}") from self.error

    def put(self, job: Callable[[], None]) -> None:
        self.check()
        self.queue.put(job)

    def drain(self) -> None:
        """Wait until everything queued is sent."""
        done = threading.Event()
        self.put(done.set)
        while not done.wait(0.1):
            self.check()
        self.check()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


class Remote:
    """The engines' ranks as the trainer's rank 0 reaches them over the links: requests and weights go through the
    :class:`Sender` (in order), answers come back on the caller's thread."""

    def __init__(self, links: Any, engines: int):
        self.links = links
        self.engines = engines
        self.sent_bytes = 0
        self.rows: list[int] = []
        """Rows each engine sent for the last step (a dump step's return trip splits by them)."""
        self.sender = Sender()

    @property
    def peers(self) -> range:
        return range(1, self.engines + 1)

    def send(self, kind: int, *values: int) -> None:
        def job() -> None:
            for k in self.peers:
                wire.send_header(self.links, k, kind, *values, up=False)

        self.sender.put(job)

    def answers(self, kind: int, step: int) -> list[wire.Reply]:
        """Each engine's answer to the last request, in engine order."""
        self.sender.check()
        replies = [wire.recv_reply(self.links, k) for k in self.peers]
        for k, r in enumerate(replies, start=1):
            if r.kind == wire.FAILED:
                raise RolloutRankFailed(f"rollout engine {k} failed at step {step}: {r.error}")
            if r.kind != kind or r.step != step:
                raise RuntimeError(f"rollout engine {k} answered kind {r.kind} for step {r.step}; expected kind {kind} "
                                   f"for step {step}")
        return replies

    def validate(self, step: int) -> Stats:
        """Every engine's validation statistics of the current weights, merged (not yet reduced)."""
        self.send(wire.VALIDATE, step)
        merged = Stats()
        for reply in self.answers(wire.VALIDATION, step):
            merged.merge(reply.stats)
        return merged

    def give_back(self, step: int, returned: dict[str, list[torch.Tensor]], rows: Sequence[int]) -> None:
        """A dump step's return trip: each engine gets the trainer's values of its ``rows[k]`` rows (in order)."""
        parts, at = [], 0
        for n in rows:
            parts.append({f: v[at : at + n] for f, v in returned.items()})
            at += n

        def job() -> None:
            for k, part in zip(self.peers, parts):
                wire.send_returned(self.links, k, step, part)

        self.sender.put(job)

    def checkpoint(self, kind: int, step: int, directory: Any) -> None:
        """Every engine writes (SAVE) or reads (RESTORE) its part under ``directory``; returns once all have."""
        def job() -> None:
            for k in self.peers:
                wire.send_path(self.links, k, kind, step, str(directory))

        self.sender.put(job)
        self.answers(wire.SAVED, step)

    def stop(self) -> None:
        """STOP to every engine, once everything before it is sent. Best effort: it runs as the run closes, often
        after a failure (a rollout rank that is gone stops with the job), and must not hide that failure."""
        try:
            self.send(wire.STOP)
            self.sender.drain()
        except Exception as exc:  # noqa: BLE001 -- see the docstring
            logger.warning("stopping the rollout ranks: %s (they stop with the job)", exc)
        finally:
            self.sender.close()


class LinkEngine:
    """The sharding manager's engine on the trainer's rank 0: a sync sends the buckets to every engine's rank."""

    def __init__(self, remote: Remote):
        self.remote = remote
        self.weight_version = -1
        """The last version queued whole (what the engines will load once the link has carried it)."""
        self._sending = False

    def update_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        remote = self.remote
        if version == self.weight_version:  # the engines have this version already (a validation's sync, again)
            return
        if not self._sending:  # a new version: the last one must be out first
            while not remote.sender.version_sent.wait(0.1):
                remote.sender.check()
            remote.sender.version_sent.clear()
            self._sending = True
        bucket = [(name, t.detach().to("cpu", copy=True)) for name, t in named_tensors]  # the exporter's are its own

        def job() -> None:
            for k in remote.peers:
                remote.sent_bytes += wire.send_bucket(remote.links, k, bucket, version)

        remote.sender.put(job)

    def finish_weight_update(self, version: int) -> None:
        if version == self.weight_version:
            return
        self.remote.send(wire.WEIGHTS, version)
        self.remote.sender.put(self.remote.sender.version_sent.set)
        self._sending = False
        self.weight_version = version

    def release_memory(self) -> None: ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...

    def flush_cache(self) -> None: ...


class StreamedRounds:
    """The trainer's :class:`~mcore_agentic.feed.rounds.Schedule` under separate placement (module docstring)."""

    def __init__(self, remote: Remote | None, *, pad_id: int, fields: Collection[str],
                 routing_shape: tuple[int, ...] | None, empty_stats: Callable[[], Stats], version: Callable[[], int],
                 max_staleness: int | None = None):
        self.remote = remote
        self.max_staleness = max_staleness
        """``rollout.max_staleness``: rows older than this are refused (the rollout ranks hold the bound)."""
        self.pad_id = pad_id
        self.fields = fields
        self.routing_shape = routing_shape
        self.empty_stats = empty_stats
        self.version = version
        self.replies: list[wire.Reply] = []

    def begin(self, rows: Rows, step: int, draw: Callable[[], Rows]) -> int:
        del rows, draw  # the rollout ranks draw their own prompts
        if self.remote is not None:
            self.remote.send(wire.WANT, step, self.version())
        return 1

    def start(self, rows: Rows, step: int, batch: int) -> None:
        raise RuntimeError("under separate placement the rollout ranks draw the prompts")

    def round(self, step: int) -> tuple[int, int, int]:
        if self.remote is None:
            return 0, 0, 0
        self.replies = self.remote.answers(wire.ROWS, step)
        groups = sum(int(r.metrics.get("rollout/streamed_groups", 0)) for r in self.replies)
        return groups, 0, 0

    def allocate(self, available: Sequence[int], wanted: int) -> list[int]:
        return [min(int(n), wanted) if g == 0 else 0 for g, n in enumerate(available)]

    def take(self, kept: int, spare: int, rounds: int) -> Rollout:
        rows, stats, metrics = None, self.empty_stats(), {}
        if self.remote is not None:
            parts = [r.parts for r in self.replies if r.parts is not None]
            rows = unpack_rows(parts, self.pad_id, self.fields, self.routing_shape) if parts else None
            self.remote.rows = [len(r.parts[0]) if r.parts is not None else 0 for r in self.replies]
            if rows is not None:
                rows = _renumber(rows, [len(p[0]) for p in parts])
            for reply in self.replies:
                stats.merge(reply.stats)
            metrics = _merge_metrics([r.metrics for r in self.replies])
            if rows is not None:
                metrics.update(staleness(rows["weight_version"], self.version()))
                oldest = metrics.get("rollout/staleness_max", 0.0)
                if self.max_staleness is not None and oldest > self.max_staleness:
                    raise RuntimeError(f"the rollout ranks sent rows {oldest:.0f} weight versions old, past "
                                       f"rollout.max_staleness={self.max_staleness}: nothing trains on them")
        metrics = broadcast_metrics(metrics)
        return Rollout(rows=rows, generated=[], group_rows=[], metrics=metrics, stats=stats)

    def round_metrics(self, result: RoundsResult, batch_size: int) -> dict[str, float]:
        return {}

    def checkpoint_parts(self) -> tuple[dict[str, Callable[[Any], None]], dict[str, Callable[[Any], None]]]:
        """``rollout_ranks/``: what each engine's rank holds (its prompts' position, the steps it generated ahead,
        its groups in flight), written and read by the rollout ranks themselves."""
        return {"rollout_ranks": self._save}, {"rollout_ranks": self._load}

    def _save(self, directory: Any) -> None:
        if self.remote is not None:
            self.remote.checkpoint(wire.SAVE, self.version(), directory)

    def _load(self, directory: Any) -> None:
        if self.remote is not None:
            self.remote.checkpoint(wire.RESTORE, self.version(), directory)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.stop()
            self.remote = None


def staleness(row_versions: torch.Tensor, version: int) -> dict[str, float]:
    """How many versions each row's oldest token is behind the weights that train it (``rollout.max_staleness``
    bounds it): the step's mean and maximum over rows that sampled anything, and the rows of each age."""
    sampled = row_versions[row_versions >= 0]
    if not sampled.numel():
        return {}
    ages = (version - sampled).double()
    out = {"rollout/staleness_mean": float(ages.mean()), "rollout/staleness_max": float(ages.max())}
    for age in range(int(ages.max()) + 1):  # the histogram: rows by age
        out[f"rollout/staleness_rows_{age}"] = float((ages == age).sum())
    return out


def _renumber(rows: Batch, counts: Sequence[int]) -> Batch:
    """Each engine numbered its groups (and episodes) from 0: offset them by the rows of the engines before it."""
    offsets = torch.repeat_interleave(torch.tensor([sum(counts[:k]) for k in range(len(counts))], dtype=torch.long),
                                      torch.tensor(list(counts), dtype=torch.long))
    updates = {name: rows[name] + offsets for name in ("group_index", "episode_index") if name in rows}
    return rows.update(updates) if updates else rows


def _merge_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The engines' schedule metrics: maxima for ``*_max`` and ages, sums for counts of groups and sessions, else means."""
    out: dict[str, float] = {}
    for name in sorted({n for p in parts for n in p}):
        values = [p[name] for p in parts if name in p]
        if name.endswith("_max") or name.endswith("_age"):
            out[name] = max(values)
        elif name.endswith(("_groups", "_paused", "_resumed", "_prioritised", "_started", "_mid_turn", "_loads",
                            "_restarts")):
            out[name] = sum(values)
        else:
            out[name] = sum(values) / len(values)
    out.pop("rollout/streamed_groups", None)
    return out


def broadcast_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Rank 0's metrics on every trainer rank (names as bytes, values as float64: tensors, no pickles)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return metrics
    names = "\n".join(sorted(metrics)).encode()
    size = comm.to_host([len(names), len(metrics)], torch.long)
    comm.broadcast_host(size, src=0)
    text = comm.host_zeros(int(size[0]), dtype=torch.uint8)
    values = comm.host_zeros(int(size[1]), dtype=torch.float64)
    if dist.get_rank() == 0:
        text = comm.to_host(torch.frombuffer(bytearray(names), dtype=torch.uint8), torch.uint8) if names else text
        values = comm.to_host([metrics[n] for n in sorted(metrics)], torch.float64)
    if text.numel():
        comm.broadcast_host(text, src=0)
    if values.numel():
        comm.broadcast_host(values, src=0)
    keys = bytes(text.tolist()).decode().split("\n") if text.numel() else []
    return {k: float(v) for k, v in zip(keys, values.tolist())}


__all__ = ["LinkEngine", "Remote", "Sender", "StreamedRounds", "broadcast_metrics", "staleness"]
