"""The planner's census equals, byte for byte, what real megatron-core builds hold on every rank.

One spawned 2-rank gloo group builds the trainer's real models (:class:`MegatronModel`, weights loaded, DDP,
the distributed optimizer, one optimizer step so Adam's moments exist) for the tiny, tiny_moe and 100m presets at
DP, TP, PP, VPP, CP and EP layouts and in bf16, and measures each rank's resident state from the tensors
themselves: the unique storages of the parameters, of their gradients, of the optimizer's own parameters (the fp32
master copy) and of Adam's state. The census (:mod:`mcore_agentic.plan.census`) answers the same questions in
one child process from meta-device builds under fake process groups; every figure must be equal.
"""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.plan.census import census_request, run_census
from tests.helpers.distributed import run_distributed

# (preset, dtype, parallel sizes): every layout of the issue on 2 ranks.
LAYOUTS: dict[str, tuple[str, str, dict]] = {
    "tiny_dp2": ("tiny", "float32", {}),
    "tiny_dp2_no_distopt": ("tiny", "float32", {"distopt": False}),
    "tiny_bf16_dp2": ("tiny", "bfloat16", {}),
    "tiny_tp2": ("tiny", "float32", {"tensor_model_parallel_size": 2}),
    "tiny_pp2": ("tiny", "float32", {"pipeline_model_parallel_size": 2}),
    "tiny_cp2": ("tiny", "float32", {"context_parallel_size": 2}),
    "moe_ep2": ("tiny_moe", "float32", {"expert_model_parallel_size": 2}),
    "moe_bf16_ep2": ("tiny_moe", "bfloat16", {"expert_model_parallel_size": 2}),
    "moe_tp2": ("tiny_moe", "float32", {"tensor_model_parallel_size": 2}),
    "100m_dp2": ("100m", "float32", {}),
    "100m_pp2_vpp2": ("100m", "float32", {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
}


def _sizes(extra: dict) -> tuple[ParallelConfig, bool]:
    extra = dict(extra)
    distopt = extra.pop("distopt", True)
    return ParallelConfig(**extra), distopt


def _storages(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _measure(megatron) -> dict[str, int]:
    """A real model's resident state, read from the tensors (not from DDP's or the optimizer's bookkeeping)."""
    params = [p for chunk in megatron.chunks for p in chunk.parameters()]
    model = {p.untyped_storage().data_ptr() for p in params}
    inner = getattr(megatron.optimizer, "chained_optimizers", [megatron.optimizer])
    opt_params = [p for o in inner for g in o.optimizer.param_groups for p in g["params"]]
    states = [v for o in inner for s in o.optimizer.state.values() for v in s.values()
              if torch.is_tensor(v) and v.dim() > 0]
    return {
        "param_bytes": _storages(params),
        "grad_bytes": _storages(getattr(p, "main_grad", None) for p in params),
        "main_param_bytes": _storages(p for p in opt_params if p.untyped_storage().data_ptr() not in model),
        "optimizer_bytes": _storages(states),
    }


def _build_all(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, dict[str, int]]:
    import megatron_patches
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.workers.config import OptimConfig
    from mcore_agentic.workers.megatron_model import MegatronModel

    megatron_patches.apply()
    out = {}
    for name, (preset, dtype, extra) in LAYOUTS.items():
        parallel, distopt = _sizes(extra)
        layout = initialize_parallel(parallel, seed=1)
        spec = ModelSpec(paths[preset], dtype, parallel=parallel)
        trained = MegatronModel(spec, layout, optim=OptimConfig(lr=1e-3), use_distributed_optimizer=distopt,
                                total_training_steps=10)
        trained.optimizer.zero_grad()
        trained.optimizer.step()  # Adam's moments are made at the first step
        out[name] = _measure(trained)
        frozen = MegatronModel(spec, layout)
        out[name]["frozen_param_bytes"] = _storages(p for chunk in frozen.chunks for p in chunk.parameters())
        del trained, frozen
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("census")
    return {preset: str(make_tiny_hf_model_from_preset(root / preset, preset))
            for preset in ("tiny", "tiny_moe", "100m")}


def test_census_equals_real_builds_on_every_rank(checkpoints):
    from mcore_agentic.models.hf_io import load_hf_config

    measured = run_distributed(_build_all, 2, args=(checkpoints,))
    requests = []
    for preset, dtype, extra in LAYOUTS.values():
        parallel, distopt = _sizes(extra)
        requests.append(census_request(load_hf_config(checkpoints[preset]), parallel, world_size=2, ranks=[0, 1],
                                       dtype=dtype, use_distributed_optimizer=distopt))
    answers = run_census(requests)
    for (name, _), ranks in zip(LAYOUTS.items(), answers, strict=True):
        for rank, state in enumerate(ranks):
            real = measured[rank][name]
            assert real["param_bytes"] > 0 and real["optimizer_bytes"] > 0, (name, rank, real)
            predicted = {key: getattr(state, key) for key in real}
            assert predicted == real, (name, rank)


def test_census_of_a_large_moe_needs_no_memory():
    """Qwen3-30B-A3B's shapes on 32 ranks (EP=8, PP=2) are counted on the meta device in seconds."""
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                        num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False,
                        architectures=["Qwen3MoeForCausalLM"])
    (first, last), = run_census([census_request(
        hf, ParallelConfig(expert_model_parallel_size=8, pipeline_model_parallel_size=2), world_size=32,
        ranks=[0, 16], dtype="bfloat16")])
    per_layer_experts = 128 // 8 * 3 * 2048 * 768
    assert first.expert_params == last.expert_params == 2 * per_layer_experts
    assert first.param_bytes == 2 * first.params
    assert first.main_param_bytes == first.optimizer_bytes // 2


def test_the_planners_tiny_configs_are_the_checkpoints_the_trainer_writes(checkpoints):
    """A missing ``outputs/models/...`` checkpoint is planned as the preset the trainer would create there."""
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.plan.known_models import resolve_hf_config

    for preset, name in (("tiny", "tiny_qwen2"), ("tiny_moe", "tiny_qwen3_moe"), ("100m", "qwen2_100m")):
        written = load_hf_config(checkpoints[preset]).to_dict()
        planned = resolve_hf_config(f"outputs/models/{name}").to_dict()
        for key in ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "num_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings"):
            assert planned.get(key) == written.get(key), (preset, key)
