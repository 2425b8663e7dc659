"""The trainer's side of separate placement (``rollout.placement=separate``): its steps' groups come from the rollout
ranks, and its weights go to them.

On the trainer's rank 0 (the only trainer rank on the links, :mod:`mcore_agentic.parallel.job`):

* :class:`LinkEngine` stands where a colocated run's engine stands in the sharding manager: each exported bucket is
  sent to every engine's rank, then the version (``WEIGHTS``). The rollout ranks load it between two rounds of their
  generation, which goes on meanwhile.
* :class:`Remote` asks every engine for a step's rows (``WANT``) or a validation (``VALIDATE``) and receives the
  answers (:mod:`.wire`).

:class:`StreamedRounds` is the trainer's schedule: one round, in which rank 0 receives each engine's share of the
step's groups, already scored and tagged, as tensors; the feed's hand-off then deals them to the DP replicas as it
deals a colocated run's. The other trainer ranks hold nothing until the hand-off (the trainer's world is one
rollout group led by rank 0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.feed import wire
from mcore_agentic.feed.distribute import unpack_rows
from mcore_agentic.feed.rounds import Rollout, RoundsResult, Rows
from mcore_agentic.parallel import comm
from mcore_agentic.parallel.stats import Stats

logger = logging.getLogger(__name__)


class RolloutRankFailed(RuntimeError):
    """A rollout rank answered with its error instead of rows."""


class Remote:
    """The engines' ranks as the trainer's rank 0 reaches them over the links."""

    def __init__(self, links: Any, engines: int):
        self.links = links
        self.engines = engines
        self.sent_bytes = 0
        self.rows: list[int] = []
        """Rows each engine sent for the last step (a dump step's return trip splits by them)."""

    @property
    def peers(self) -> range:
        return range(1, self.engines + 1)

    def send(self, kind: int, *values: int) -> None:
        for k in self.peers:
            wire.send_header(self.links, k, kind, *values, up=False)

    def answers(self, kind: int, step: int) -> list[wire.Reply]:
        """Each engine's answer to the last request, in engine order."""
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
        return wire.merge_stats([r.stats for r in self.answers(wire.VALIDATION, step)], Stats())

    def give_back(self, step: int, returned: dict[str, list[torch.Tensor]], rows: Sequence[int]) -> None:
        """A dump step's return trip: each engine gets the trainer's values of its ``rows[k]`` rows (in order)."""
        at = 0
        for k, n in zip(self.peers, rows):
            wire.send_returned(self.links, k, step, {f: v[at : at + n] for f, v in returned.items()})
            at += n

    def checkpoint(self, kind: int, step: int, directory: Any) -> None:
        """Every engine writes (SAVE) or reads (RESTORE) its part under ``directory``; returns once all have."""
        for k in self.peers:
            wire.send_path(self.links, k, kind, step, str(directory))
        self.answers(wire.SAVED, step)

    def stop(self) -> None:
        self.send(wire.STOP)


class LinkEngine:
    """The sharding manager's engine on the trainer's rank 0: a sync sends the buckets to every engine's rank."""

    def __init__(self, remote: Remote):
        self.remote = remote
        self.weight_version = -1
        """The last version sent whole (what the engines will load)."""

    def update_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        for k in self.remote.peers:
            self.remote.sent_bytes += wire.send_bucket(self.remote.links, k, named_tensors, version)

    def finish_weight_update(self, version: int) -> None:
        self.remote.send(wire.WEIGHTS, version)
        self.weight_version = version

    def release_memory(self) -> None: ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...

    def flush_cache(self) -> None: ...


class StreamedRounds:
    """The trainer's :class:`~mcore_agentic.feed.rounds.Schedule` under separate placement (module docstring)."""

    def __init__(self, remote: Remote | None, *, pad_id: int, fields: Collection[str],
                 routing_shape: tuple[int, ...] | None, empty_stats: Callable[[], Stats], version: Callable[[], int]):
        self.remote = remote
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
            wire.merge_stats([r.stats for r in self.replies], stats)
            metrics = _merge_metrics([r.metrics for r in self.replies])
            if rows is not None:
                metrics.update(staleness(rows["weight_version"], self.version()))
        metrics = broadcast_metrics(metrics)
        return Rollout(rows=rows, generated=[], group_rows=[], metrics=metrics, streamed=True, stats=stats)

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
    import torch.distributed as dist

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


__all__ = ["LinkEngine", "Remote", "RolloutRankFailed", "StreamedRounds", "broadcast_metrics", "staleness"]
