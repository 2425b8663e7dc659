"""The teacher's own tensor-parallel groups (:func:`own_tp_layout`) on real gloo ranks: what each group holds, and
what making them costs (GPU review m5: no ``new_group`` per rank of the world on every rank)."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed


def _own_groups(rank: int, world_size: int, tps: tuple[int, ...]) -> dict:
    """For each TP: the ``new_group`` calls this rank made (their ranks) and what each group of the layout holds,
    checked by a sum over it. The layouts are made one after another, as a run with two teachers would."""
    import torch
    import torch.distributed as dist

    from mcore_agentic.parallel.layout import ParallelLayout
    from mcore_agentic.parallel.own_layout import own_tp_layout

    made: list[list[int]] = []
    real = dist.new_group

    def counted(ranks=None, *args, **kwargs):
        made.append(sorted(ranks) if ranks is not None else list(range(world_size)))
        return real(ranks, *args, **kwargs)

    dist.new_group = counted
    student = ParallelLayout(
        world_size=world_size, rank=rank, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, data_parallel_size=world_size, tp_rank=0,
        pp_rank=0, cp_rank=0, dp_rank=rank, expert_model_parallel_size=1, ep_rank=0, backend="gloo",
    )
    out = {}
    try:
        for tp in tps:
            made.clear()
            own = own_tp_layout(tp, student)
            sums = {}
            for name, group in (("tp", own.tp_group()), ("dp", own.dp_group()), ("self", own.pp_group()),
                                ("cp", own.cp_group()), ("ep", own.ep_group())):
                t = torch.tensor([float(1 << rank)])
                dist.all_reduce(t, group=group)
                sums[name] = (dist.get_world_size(group), int(t.item()))
            out[tp] = {"made": list(made), "sums": sums, "tp_rank": own.tp_rank, "dp_rank": own.dp_rank}
    finally:
        dist.new_group = real
    return out


@pytest.mark.parametrize("world_size, tps", [(2, (1, 2)), (4, (1, 2, 4))], ids=["world2", "world4"])
def test_each_rank_makes_its_own_group_alone_and_every_group_holds_its_ranks(world_size: int, tps: tuple[int, ...]):
    """No rank makes another rank's single-rank group (before: ``world`` of them on every rank, one per rank); the
    groups the ranks make together are one per TP block and one per DP set, and none for a split of single ranks."""
    results = run_distributed(_own_groups, world_size=world_size, args=(tps,))
    for rank, per_tp in enumerate(results):
        for tp, got in per_tp.items():
            alone = [m for m in got["made"] if len(m) == 1]
            assert alone == [[rank]], (rank, tp, got["made"])
            together = [m for m in got["made"] if len(m) > 1]
            blocks = [list(range(b * tp, (b + 1) * tp)) for b in range(world_size // tp)] if tp > 1 else []
            dp_sets = [list(range(i, world_size, tp)) for i in range(tp)] if tp < world_size else []
            assert together == blocks + dp_sets, (rank, tp, got["made"])
            block = range(rank - rank % tp, rank - rank % tp + tp)
            dp_set = range(rank % tp, world_size, tp)
            assert got["sums"] == {
                "tp": (tp, sum(1 << r for r in block)),
                "dp": (world_size // tp, sum(1 << r for r in dp_set)),
                "self": (1, 1 << rank), "cp": (1, 1 << rank), "ep": (1, 1 << rank),
            }, (rank, tp)
            assert (got["tp_rank"], got["dp_rank"]) == (rank % tp, rank // tp)
