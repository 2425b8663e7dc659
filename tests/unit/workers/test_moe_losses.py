"""``actor.moe`` router losses in the PPO update (tiny Qwen3-MoE, EP=2 over 2 gloo ranks).

With zero advantages (and no entropy or KL term) the load-balancing loss is the only gradient: it is zero
with ``aux_loss_coeff=0``, non-zero with 0.1, and it is a mean over the mini-batch's tokens, so the same
rows twice over in one optimizer step (twice the tokens, each micro-batch twice) give the same gradient, not
twice it.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import make_tiny_hf
from tests.unit.sharding._fixtures import make_batch


def _grad_norm(path: str, aux: float, copies: int, layout) -> float:
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.data.batch import Batch
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, MoEConfig, OptimConfig

    rows = 2 * 8 * copies  # both DP ranks' rows: one optimizer step over every row, micro-batches of 2
    cfg = ActorConfig(parallel=layout.cfg, ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=2, shuffle=False,
                      optim=OptimConfig(lr=1e-3), policy_loss=PolicyLossConfig(entropy_coeff=0.0),
                      moe=MoEConfig(aux_loss_coeff=aux))
    actor = Actor(cfg, mini_batch_sequences=rows, model_path=path, dtype="float32", layout=layout.value)
    batch = Batch.concat([make_batch(8)] * copies)
    batch = actor.compute_log_prob(batch.update({"advantages": torch.zeros_like(batch["advantages"])}))
    return float(actor.update_policy(batch)["grad_norm"])


def _body(rank: int, world_size: int, path: str) -> bytes:
    from types import SimpleNamespace

    import megatron_patches
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel

    megatron_patches.apply()
    par = ParallelConfig(expert_model_parallel_size=2)
    layout = SimpleNamespace(cfg=par, value=initialize_parallel(par, seed=1))
    out = {"off": _grad_norm(path, 0.0, 1, layout), "on": _grad_norm(path, 0.1, 1, layout),
           "on_twice": _grad_norm(path, 0.1, 2, layout)}
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    path = make_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("moe") / "qwen3_moe")
    return [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_body, 2, args=(str(path),))]


def test_aux_loss_is_honoured_as_a_mean_over_tokens(runs):
    for out in runs:
        assert out["off"] == 0.0
        assert out["on"] > 1e-6
        assert out["on_twice"] == pytest.approx(out["on"], rel=1e-5)
