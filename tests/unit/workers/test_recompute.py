"""Activation recomputation changes memory, never the numbers: every mode's loss and gradients equal the run without.

One spawned group of 2 gloo ranks runs each layout in turn (TP=2 with sequence parallelism, PP=2 with VPP=2, CP=2,
and a Qwen3-MoE actor at EP=2); per layout an actor is built without recomputation and with each mode
(``actor.recompute_*``: full uniform, full block, selective with every module that applies), each runs one
forward-backward of the PPO objective (entropy bonus on) over the same packed micro-batches, and each rank's loss
and its own gradient shards (the DDP ``main_grad`` buffers) are compared with the run without recomputation, in fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack

TOL = 1e-6
LENGTHS = [120, 7, 60, 33, 90, 3, 41, 18]  # response tokens per row, micro-batches of 2 rows (VPP needs several)


def _modes(moe: bool) -> dict[str, dict[str, Any]]:
    selective = ["core_attn", "layernorm", "moe"] if moe else ["core_attn", "layernorm", "mlp"]
    return {
        "full_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        "full_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
        "selective": {"recompute_granularity": "selective", "recompute_modules": tuple(selective)},
    }


LAYOUTS = {
    # name: (parallel sizes, moe)
    "tp2_sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True), False),
    "pp2_vpp2": (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), False),
    "cp2": (dict(context_parallel_size=2), False),
    "ep2_moe": (dict(expert_model_parallel_size=2), True),
}


def _pass(path: str, par: Any, layout: Any, recompute: dict[str, Any]) -> dict[str, Any]:
    """One forward-backward of the PPO objective over this replica's rows: the loss shares and the gradient shards."""
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig, RecomputeConfig
    from mcore_agentic.workers.passes import dp_share, global_normalisers, log_prob_head
    from tests.unit.workers._fixtures import make_batch

    n = len(LENGTHS)
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=2,
                      policy_loss=PolicyLossConfig(entropy_coeff=0.01), optim=OptimConfig(lr=1e-4),
                      recompute=RecomputeConfig(**recompute))
    actor = Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=n)
    batch = actor.compute_log_prob(make_batch(n, response_lengths=LENGTHS))
    batch = dp_share(batch, layout)
    model = actor.model
    norms = global_normalisers(batch["response_mask"], layout)
    model.zero_grad()
    sums = model.forward_backward(batch, log_prob_head(model, actor.temperature, True),
                                   actor._ppo_loss_fn(norms, None), actor.batching)
    grads = [p.main_grad.detach().clone() for chunk in model.chunks for p in chunk.parameters() if p.requires_grad]
    return {"sums": sums, "grads": grads, "granularity": model.tcfg.recompute_granularity}


def _body(rank: int, world_size: int, dense: str, moe: str) -> bytes:
    import megatron_patches
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel

    megatron_patches.apply()
    out: dict[str, Any] = {}
    for name, (sizes, is_moe) in LAYOUTS.items():
        par = ParallelConfig(**sizes)
        layout = initialize_parallel(par, 1)
        path = moe if is_moe else dense
        runs = {"none": _pass(path, par, layout, {})}
        for mode, recompute in _modes(is_moe).items():
            runs[mode] = _pass(path, par, layout, recompute)
        out[name] = runs
        destroy_parallel()
    return pack(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    from tests.unit.models._hf_fixtures import make_tiny_hf as make_tiny_arch
    from tests.unit.workers._fixtures import make_tiny_hf

    root = tmp_path_factory.mktemp("recompute")
    dense = make_tiny_hf(root / "dense", layers=4, max_positions=256)
    moe = make_tiny_arch("Qwen3MoeForCausalLM", root / "moe")
    return [unpack(r) for r in run_distributed(_body, 2, args=(str(dense), str(moe)))]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_recomputation_mode_gives_the_same_loss_and_gradients(results, layout):
    for rank, res in enumerate(results):
        runs = res[layout]
        base = runs["none"]
        assert base["granularity"] is None
        assert base["sums"]["pg_loss"] != 0 and any(g.abs().sum() > 0 for g in base["grads"])
        for mode in _modes(layout.endswith("moe")):
            run = runs[mode]
            assert run["granularity"] == _modes(False)[mode]["recompute_granularity"]  # megatron-core got it
            assert run["sums"].keys() == base["sums"].keys()
            for key, value in base["sums"].items():
                assert run["sums"][key] == pytest.approx(value, rel=TOL, abs=TOL), (layout, mode, rank, key)
            assert len(run["grads"]) == len(base["grads"])
            for i, (got, want) in enumerate(zip(run["grads"], base["grads"], strict=True)):
                torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * max(want.abs().max().item(), 1e-12),
                                           msg=lambda m, w=f"{layout} {mode} rank {rank} grad {i}": f"{w}: {m}")
