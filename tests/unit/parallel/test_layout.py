"""Parallel-size validation (one-line ConfigError naming the field) and process-group setup at TP=2 on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

from mcore_agentic.config.rules import check_model_split, check_world_size
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.parallel.layout import check_cpu_support
from mcore_agentic.utils.errors import ConfigError
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack

MODEL = dict(num_attention_heads=8, num_query_groups=2, num_layers=4)


def _check(
    cfg: ParallelConfig, world_size: int = 4, *, cuda_available: bool | None = None, apply_rope_fusion: bool = False,
    field_prefix: str = "actor", **shape: Any,
) -> None:
    """The launcher's pre-flight order: world size, the model's split, then what CPU cannot run."""
    check_world_size(cfg, world_size, field_prefix=field_prefix)
    check_model_split(cfg, **{**MODEL, **shape}, field_prefix=field_prefix)
    check_cpu_support(cfg, field_prefix=field_prefix, apply_rope_fusion=apply_rope_fusion, cuda_available=cuda_available)


@pytest.mark.parametrize(
    "cfg, world_size, field, fragment",
    [
        (ParallelConfig(tensor_model_parallel_size=3), 2, "actor.tensor_model_parallel_size", "not divisible by TP*PP*CP"),
        (ParallelConfig(pipeline_model_parallel_size=3), 4, "actor.pipeline_model_parallel_size", "divisors: 1, 2, 4"),
        (ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=3), 4, "actor.context_parallel_size", "= 6"),
        (ParallelConfig(tensor_model_parallel_size=4), 4, "actor.tensor_model_parallel_size", "num_query_groups"),
        (ParallelConfig(pipeline_model_parallel_size=8), 8, "actor.pipeline_model_parallel_size", "num_layers=4"),
        (
            ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
            2,
            "actor.virtual_pipeline_model_parallel_size",
            "PP*VPP = 2*4 = 8",
        ),
        (ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 2, "actor.sequence_parallel", "CPU"),
    ],
)
def test_validation_errors_name_the_field(cfg, world_size, field, fragment):
    with pytest.raises(ConfigError) as info:
        _check(cfg, world_size, cuda_available=False)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(field + ":") and fragment in message and "\n" not in message


def test_heads_not_divisible():
    with pytest.raises(ConfigError, match="num_attention_heads=6"):
        _check(ParallelConfig(tensor_model_parallel_size=4), 4, num_attention_heads=6, num_query_groups=None, num_layers=2)


def test_fused_rope_refused_on_cpu_and_field_prefix():
    with pytest.raises(ConfigError) as info:
        _check(ParallelConfig(), apply_rope_fusion=True, cuda_available=False, field_prefix="critic")
    assert info.value.field == "critic.apply_rope_fusion" and "TransformerEngine" in str(info.value)


def test_valid_layouts_pass():
    _check(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    _check(ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 2)
    _check(ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2))
    _check(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), cuda_available=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size"),
        ({"context_parallel_size": True}, "context_parallel_size"),
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size"),
        ({"sequence_parallel": True}, "sequence_parallel"),
    ],
)
def test_config_post_init(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs)
    assert info.value.field == field


def _init_tp2(rank: int, world_size: int) -> bytes:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    import megatron_patches
    from mcore_agentic.parallel.layout import destroy_parallel, init_distributed, initialize_parallel

    megatron_patches.apply()
    init_distributed(timeout_minutes=7)  # already initialised here: sets the timeout of the groups made next
    layout = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2), seed=5)
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60
                for g in (layout.tp_group(), layout.dp_group(), layout.replica_group())]
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t, group=layout.tp_group())
    with get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(2)
    out = {
        "layout": layout,
        "tp_sum": float(t),
        "tp_group_size": layout.tp_group().size(),
        "dp_group_size": layout.dp_group().size(),
        "describe": layout.describe(),
        "tp_draw": tp_draw,
        "timeouts": timeouts,
    }
    destroy_parallel()
    return pack(out)


def test_initialize_tp2_on_two_ranks():
    results = [unpack(r) for r in run_distributed(_init_tp2, 2)]
    for rank, res in enumerate(results):
        lay = res["layout"]
        assert (lay.world_size, lay.rank, lay.tensor_model_parallel_size, lay.data_parallel_size) == (2, rank, 2, 1)
        assert (lay.tp_rank, lay.pp_rank, lay.cp_rank, lay.dp_rank) == (rank, 0, 0, 0)
        assert lay.backend == "gloo" and lay.pp_rank == 0 and lay.is_pipeline_last_stage
        assert res["tp_sum"] == 3.0 and res["tp_group_size"] == 2 and res["dp_group_size"] == 1
        assert res["describe"].startswith(f"rank {rank}/2: TP 2 (rank {rank})")
        assert res["timeouts"] == [7.0, 7.0, 7.0], "trainer.dist_timeout_minutes reaches Megatron's and our groups"
    # The tracker was seeded per TP rank: the model-parallel streams differ.
    assert not results[0]["tp_draw"].equal(results[1]["tp_draw"])


def _init_ep2(rank: int, world_size: int) -> bytes:
    import torch

    import megatron_patches
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel

    megatron_patches.apply()
    layout = initialize_parallel(ParallelConfig(expert_model_parallel_size=2), seed=5)
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t, group=layout.ep_group())
    out = {
        "layout": layout,
        "ep_sum": float(t),
        "expert_dp_size": layout.expert_dp_group().size(),
        "model_ep_is_layout_ep": layout.process_groups().ep is layout.ep_group(),
        "describe": layout.describe(),
    }
    destroy_parallel()
    return pack(out)


def test_expert_parallelism_is_part_of_the_layout():
    """EP=2 over DP=2: the layout carries the EP size, this rank's EP index and the EP groups (the ones a model is
    built with)."""
    for rank, res in enumerate(unpack(r) for r in run_distributed(_init_ep2, 2)):
        lay = res["layout"]
        assert (lay.expert_model_parallel_size, lay.ep_rank, lay.data_parallel_size) == (2, rank, 2)
        assert res["ep_sum"] == 3.0 and res["expert_dp_size"] == 1 and res["model_ep_is_layout_ep"]
        assert res["describe"].endswith(f"DP 2 (rank {rank}) EP 2 (rank {rank}), gloo")
