"""Statistics of values spread over ranks: sums, counts, maxima and minima, reduced in two all-reduces.

Metrics of a step whose rows are spread over the data-parallel replicas (or whose rollouts sit on
the rollout leaders) never need the rows in one place: each rank adds its values under a name,
:meth:`Stats.reduce` all-reduces one float64 vector of sums and counts and one of maxima (minima
negated), and every rank reads the same global mean, sum, max or min. Every rank of the group must
add the same names (an empty tensor is fine: it counts 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm

__all__ = ["Stats", "sum_over"]


@dataclass
class Stats:
    """Named running sum / count / max / min; :meth:`reduce` makes them global over a process group."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, values: torch.Tensor | Sequence[float]) -> Stats:
        if isinstance(values, torch.Tensor):
            t = values.detach().to("cpu", torch.float64).reshape(-1)  # one host copy per name
        else:
            t = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        self.sums[name] = self.sums.get(name, 0.0) + float(t.sum())
        self.counts[name] = self.counts.get(name, 0.0) + t.numel()
        if t.numel():
            self.maxs[name] = max(self.maxs.get(name, -float("inf")), float(t.max()))
            self.mins[name] = min(self.mins.get(name, float("inf")), float(t.min()))
        else:
            self.maxs.setdefault(name, -float("inf"))
            self.mins.setdefault(name, float("inf"))
        return self

    def merge(self, other: Stats) -> Stats:
        """``other``'s values added to these, in place (sums and counts added, maxima and minima kept): one place's
        statistics from several (a trainer's rank 0 merging the rollout ranks'); returns self."""
        for name in other.sums:
            self.sums[name] = self.sums.get(name, 0.0) + other.sums[name]
            self.counts[name] = self.counts.get(name, 0.0) + other.counts[name]
            self.maxs[name] = max(self.maxs.get(name, -float("inf")), other.maxs[name])
            self.mins[name] = min(self.mins.get(name, float("inf")), other.mins[name])
        return self

    def reduce(self, group: dist.ProcessGroup | None = None, *, world: bool = False) -> Stats:
        """Global values over ``group`` (or the whole world with ``world=True``); no-op on one rank."""
        if not dist.is_initialized() or (group is None and not world):
            return self
        if dist.get_world_size(group) == 1:
            return self
        names = sorted(self.sums)
        additive = comm.to_host([self.sums[n] for n in names] + [self.counts[n] for n in names], torch.float64)
        extreme = comm.to_host([self.maxs[n] for n in names] + [-self.mins[n] for n in names], torch.float64)
        comm.all_reduce_host(additive, group=group)
        comm.all_reduce_host(extreme, op=dist.ReduceOp.MAX, group=group)
        k = len(names)
        for i, n in enumerate(names):
            self.sums[n], self.counts[n] = float(additive[i]), float(additive[k + i])
            self.maxs[n], self.mins[n] = float(extreme[i]), -float(extreme[k + i])
        return self

    def count(self, name: str) -> float:
        return self.counts.get(name, 0.0)

    def total(self, name: str) -> float:
        return self.sums.get(name, 0.0)

    def mean(self, name: str) -> float:
        return self.sums[name] / self.counts[name] if self.counts.get(name) else 0.0

    def max(self, name: str) -> float:
        return self.maxs[name] if self.counts.get(name) else 0.0

    def min(self, name: str) -> float:
        return self.mins[name] if self.counts.get(name) else 0.0

    def summary(self, name: str, label: str | None = None) -> dict[str, float]:
        """``{label/mean, label/max, label/min}`` (empty when nothing was counted anywhere)."""
        if not self.counts.get(name):
            return {}
        label = label or name
        return {f"{label}/mean": self.mean(name), f"{label}/max": self.max(name), f"{label}/min": self.min(name)}


def sum_over(group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM):
    """A function summing (or, with ``op``, otherwise reducing) a tensor over ``group`` (a float64 host
    all-reduce; the result comes back on the tensor's device and dtype; identity without a group)."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return t
        out = comm.all_reduce_host(comm.to_host(t, torch.float64), op=op, group=group)
        return out.to(device=t.device, dtype=t.dtype)

    return reduce


def max_over(group: dist.ProcessGroup | None):
    """A function taking a tensor's elementwise maximum over ``group``."""
    return sum_over(group, dist.ReduceOp.MAX)
