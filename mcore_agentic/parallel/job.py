"""The job's ranks under separate rollout placement (``rollout.placement=separate``): trainer ranks, rollout ranks,
and the two links between them.

One torchrun (or Slurm) job of ``W`` ranks; the last ``rollout.rollout_ranks`` generate, the first ``T = W - R``
train. :func:`init_job` splits the world before anything else runs:

* each side gets a default process group of its own from the job's store (a ``PrefixStore`` per side): the
  trainer's ``T`` ranks form the world Megatron builds its groups in, so every trainer collective is the colocated
  run's, unchanged; each rollout rank is a world of one (its engine, tools and rounds are its own: no rollout rank
  waits for another);
* ``RANK`` and ``WORLD_SIZE`` become the side's (``JOB_RANK`` and ``JOB_WORLD_SIZE`` keep the job's), so code that
  reads them sees the world it runs in;
* the **links**: two gloo groups of the trainer's rank 0 and each rollout group's first rank (its engine's rank),
  built from the same store outside both worlds. ``down`` carries the trainer's control messages and weights to the
  rollout ranks, ``up`` the finished groups back; a rollout rank reads ``down`` on a thread of its own while it
  generates, so the two never share a group between threads.

Rank 0 of the link is the trainer's rank 0; rank ``k`` (1-based) is the ``k``-th rollout engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm


class RolloutRankFailed(RuntimeError):
    """A rollout rank answered the trainer with its error instead of rows (the launcher says it in one line)."""


@dataclass(frozen=True)
class JobSplit:
    """This rank's place in a job split into trainer and rollout ranks."""

    world_size: int
    """The job's ranks."""
    rollout_ranks: int
    rollout_tp: int
    """Ranks per rollout engine (``rollout.tensor_model_parallel_size``)."""
    rank: int
    """This rank in the job."""

    def __post_init__(self) -> None:
        if not 0 < self.rollout_ranks < self.world_size:
            raise ValueError(f"{self.rollout_ranks} rollout ranks leave no trainer rank in a job of {self.world_size}")
        if self.rollout_ranks % self.rollout_tp:
            raise ValueError(f"{self.rollout_ranks} rollout ranks do not split into engines of {self.rollout_tp}")

    @property
    def trainer_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainer_ranks

    @property
    def engines(self) -> int:
        """Rollout engines (the first rank of each group of ``rollout_tp`` rollout ranks holds one)."""
        return self.rollout_ranks // self.rollout_tp

    @property
    def engine_index(self) -> int | None:
        """Which engine this rank's group runs (None on a trainer rank)."""
        return (self.rank - self.trainer_ranks) // self.rollout_tp if self.is_rollout else None

    @property
    def leads_engine(self) -> bool:
        return self.is_rollout and (self.rank - self.trainer_ranks) % self.rollout_tp == 0

    @property
    def link_members(self) -> list[int]:
        """Job ranks on the links: the trainer's rank 0, then each engine's rank."""
        return [0] + [self.trainer_ranks + k * self.rollout_tp for k in range(self.engines)]

    @property
    def side_rank(self) -> int:
        return self.rank if not self.is_rollout else 0

    @property
    def side_size(self) -> int:
        return self.trainer_ranks if not self.is_rollout else 1


@dataclass
class Links:
    """This rank's ends of the links (module docstring); ``peer`` numbers: 0 the trainer, ``k`` the k-th engine."""

    split: JobSplit
    down: Any
    up: Any

    def send(self, t: torch.Tensor, peer: int, tag: int, *, up: bool) -> None:
        comm.send_link(t, self.up if up else self.down, peer, tag)

    def recv(self, t: torch.Tensor, peer: int, tag: int, *, up: bool) -> torch.Tensor:
        return comm.recv_link(t, self.up if up else self.down, peer, tag)


_SPLIT: JobSplit | None = None
_LINKS: Links | None = None


def split_from_env(rollout_ranks: int, rollout_tp: int) -> JobSplit:
    """The split of the job torchrun (or the test's helper) started, from ``RANK`` and ``WORLD_SIZE``."""
    world = int(os.environ.get("JOB_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    rank = int(os.environ.get("JOB_RANK", os.environ.get("RANK", "0")))
    return JobSplit(world, rollout_ranks, rollout_tp, rank)


def init_job(split: JobSplit, timeout_minutes: int) -> Links | None:
    """Split the job (module docstring): this side's default process group, and the links where this rank is on
    them (None elsewhere). Call it instead of :func:`~.layout.init_distributed`, before anything else."""
    global _SPLIT, _LINKS
    if dist.is_initialized():
        raise RuntimeError("init_job: torch.distributed is already initialised; split the job first")
    comm.enable_strict_from_env()
    timeout = timedelta(minutes=timeout_minutes)
    store, _, _ = next(dist.rendezvous("env://", rank=split.rank, world_size=split.world_size, timeout=timeout))
    os.environ.update(JOB_RANK=str(split.rank), JOB_WORLD_SIZE=str(split.world_size),
                      RANK=str(split.side_rank), WORLD_SIZE=str(split.side_size))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    side = "trainer" if not split.is_rollout else f"rollout{split.rank}"
    backend = comm.backend_for("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group(backend=backend, store=dist.PrefixStore(side, store), rank=split.side_rank,
                            world_size=split.side_size, timeout=timeout)
    _SPLIT = split
    members = split.link_members
    if split.rank in members:
        me = members.index(split.rank)
        made = [dist.ProcessGroupGloo(dist.PrefixStore(f"link/{name}", store), me, len(members), timeout)
                for name in ("down", "up")]
        _LINKS = Links(split, *made)
    return _LINKS


def job_split() -> JobSplit | None:
    """The split :func:`init_job` made in this process (None: a colocated run)."""
    return _SPLIT


def job_links() -> Links | None:
    """This rank's links (None off them, or in a colocated run)."""
    return _LINKS


def job_store(timeout_s: float = 30.0) -> Any:
    """A client of the job's own key-value store (torchrun's agent's, or rank 0's: ``MASTER_ADDR:MASTER_PORT``), the
    one store both sides of a split job see alike (each side's default group keys live under a prefix of their own);
    None where none is reachable."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 -- no job store reachable (a world of one without one)
        return None


__all__ = ["JobSplit", "Links", "RolloutRankFailed", "init_job", "job_links", "job_split", "job_store",
           "split_from_env"]
