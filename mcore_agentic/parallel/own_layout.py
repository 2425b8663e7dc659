"""A second model's own tensor-parallel split in the trainer's processes (the distillation teacher's).

Megatron's ``parallel_state`` holds one layout per process: the actor's. A model built with an explicit
``pg_collection`` uses the groups it is given instead, and so do the forward schedule and this package's engine
(every group it reads comes from its :class:`~mcore_agentic.parallel.layout.ParallelLayout`). :func:`own_tp_layout`
makes such a set of groups: tensor parallelism over consecutive blocks of ``tp`` global ranks (a node's GPUs when
``tp`` divides the GPUs per node), no pipeline, context or expert parallelism, data parallelism over the other
blocks. A teacher larger than the student's model-parallel split can then be spread over more GPUs than the
student is, or a small teacher over fewer.

The rows are the student's: each rank holds its DP replica's (:attr:`OwnLayout.student_dp_rank`), so a block of
the own split scores the rows of every student replica among its ranks (the teacher gathers them:
:mod:`mcore_agentic.workers.teacher`).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mcore_agentic.parallel import layout as _layout
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.parallel.layout import ParallelLayout, new_groups

__all__ = ["OwnLayout", "own_tp_layout", "own_tp_split"]


@dataclasses.dataclass(frozen=True)
class OwnLayout(ParallelLayout):
    """A :class:`ParallelLayout` whose process groups are its own, not ``parallel_state``'s (TP only)."""

    groups: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    student_dp_rank: int = 0
    """This rank's DP replica in the actor's layout: whose rows it holds."""

    def tp_group(self) -> dist.ProcessGroup:
        return self.groups["tp"]

    def pp_group(self) -> dist.ProcessGroup:
        return self.groups["self"]

    def cp_group(self) -> dist.ProcessGroup:
        return self.groups["self"]

    def dp_group(self, with_context_parallel: bool = False) -> dist.ProcessGroup:
        return self.groups["dp"]

    def ep_group(self) -> dist.ProcessGroup:
        return self.groups["self"]

    def expert_dp_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def process_groups(self) -> Any:
        """Megatron's ``ProcessGroupCollection`` of these groups: TP is the model-parallel group; every pipeline,
        context and expert group is the rank alone (experts whole on every rank: expert TP 1, EP 1, so the ranks
        holding the same experts are the world)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        tp, alone, dp, world = self.groups["tp"], self.groups["self"], self.groups["dp"], dist.group.WORLD
        pgs = ProcessGroupCollection()
        for name, group in {
            "tp": tp, "mp": tp, "tp_cp": tp, "pp": alone, "cp": alone, "embd": alone, "pos_embd": alone,
            "ep": alone, "expt_tp": alone, "tp_ep": alone, "tp_ep_pp": alone, "expt_dp": world, "intra_expt_dp": world,
            "dp": dp, "dp_cp": dp, "intra_dp_cp": dp, "tp_dp_cp": world,
        }.items():
            setattr(pgs, name, group)
        return pgs

    def replica_group(self) -> dist.ProcessGroup | None:
        return self.groups["tp"] if self.tensor_model_parallel_size > 1 else None

    def replica_ranks(self, dp_rank: int) -> list[int]:
        t = self.tensor_model_parallel_size
        return list(range(dp_rank * t, (dp_rank + 1) * t))

    def describe(self) -> str:
        return f"own split TP={self.tensor_model_parallel_size} x DP={self.data_parallel_size} (ranks in blocks of TP)"


def own_tp_layout(tp: int, student: ParallelLayout) -> OwnLayout:
    """Process groups of a tensor-parallel split of ``tp`` over consecutive ranks, for a model beside the actor's
    (``student``: the actor's layout, whose replica rows each rank holds). Collective over the world."""
    world, rank = student.world_size, student.rank
    if tp < 1 or world % tp:
        raise ValueError(f"a tensor-parallel split of {tp} does not divide the world of {world} ranks")
    blocks = [list(range(b * tp, (b + 1) * tp)) for b in range(world // tp)]
    alone = _self_group(rank)
    groups = {  # a split of single ranks (TP 1, or DP 1) is the rank alone: no group made per rank of the world
        "tp": new_groups(blocks, rank) if tp > 1 else alone,
        "dp": new_groups([list(range(i, world, tp)) for i in range(tp)], rank) if tp < world else alone,
        "self": alone,
    }
    return OwnLayout(
        world_size=world, rank=rank, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, data_parallel_size=world // tp,
        tp_rank=rank % tp, pp_rank=0, cp_rank=0, dp_rank=rank // tp, expert_model_parallel_size=1, ep_rank=0,
        backend=student.backend, groups=groups, student_dp_rank=student.dp_rank,
    )


def _self_group(rank: int) -> dist.ProcessGroup:
    """A process group of ``rank`` alone, made by this rank only (GPU review m5): ``new_group`` with local
    synchronisation, which the other ranks do not enter, instead of every rank making every rank's group (``world``
    calls on each rank). It takes no name from the world's count of groups, so the groups the ranks make together
    afterwards keep the same names on every rank."""
    group = dist.new_group([rank], timeout=timedelta(minutes=_layout._TIMEOUT_MINUTES), use_local_synchronization=True)
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"rank {rank} could not make a process group of itself alone (got {group!r})")
    return group


def own_tp_split(par: ParallelConfig, tp: int) -> ParallelConfig:
    """The model split of :func:`own_tp_layout`'s groups (``par``: the actor's, for everything not about the
    split): TP ``tp``, nothing else split, experts whole on every rank."""
    return dataclasses.replace(
        par, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1, sequence_parallel=False, expert_model_parallel_size=1, expert_tensor_parallel_size=1,
    )
