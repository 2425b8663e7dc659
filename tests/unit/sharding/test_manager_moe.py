"""Weight sync of a mixture-of-experts actor at EP=2 into the transformers engine.

Each rank's actor holds 4 of the 8 experts per layer; the streamed export gathers them over the EP
group and the engine, holding its experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]),
fills them from the per-expert tensors. After the sync (and after a PPO update and a second sync) the
engine's teacher-forced log-probs equal the actor's old log-probs (fp32); the streamed buckets equal
the simple export bitwise. The same spawn checks the ``actor.moe`` router losses.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import make_tiny_hf
from tests.unit.sharding._fixtures import make_batch, teacher_forced_log_probs

TOL = 1e-5


def _aux_grad_norm(path: str, aux: float, copies: int, par, layout) -> float:
    """Grad norm of one PPO step with zero advantages (no entropy or KL term): the router loss's gradient only."""
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.data.batch import Batch
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, MoEConfig, OptimConfig

    rows = 2 * 8 * copies  # both DP ranks' rows: one optimizer step over every row, micro-batches of 2
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=2, shuffle=False,
                      optim=OptimConfig(lr=1e-3), policy_loss=PolicyLossConfig(entropy_coeff=0.0),
                      moe=MoEConfig(aux_loss_coeff=aux))
    actor = Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=rows)
    batch = Batch.concat([make_batch(8)] * copies)
    batch = actor.compute_log_prob(batch.update({"advantages": torch.zeros_like(batch["advantages"])}))
    return float(actor.update_policy(batch)["grad_norm"])


def _body(rank: int, world_size: int, path: str) -> bytes:
    import transformers

    import megatron_patches
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.rollout.engines.hf import HFEngine
    from mcore_agentic.sharding.config import ShardingConfig
    from mcore_agentic.sharding.exporter import StreamingExporter
    from mcore_agentic.sharding.manager import ShardingManager
    from mcore_agentic.sharding.transports import WeightVersion
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig

    megatron_patches.apply()
    par = ParallelConfig(expert_model_parallel_size=2)
    layout = initialize_parallel(par, seed=1)
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                      optim=OptimConfig(lr=2e-2), policy_loss=PolicyLossConfig(entropy_coeff=0.0))
    actor = Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)  # the engine starts from other weights
        engine = HFEngine(transformers.Qwen3MoeForCausalLM(load_hf_config(path)).eval())
    version = WeightVersion()
    manager = ShardingManager(actor, engine, ShardingConfig(bucket_size_mb=0.05), version=version, rollout_seed=7)
    reference = actor.model.export_hf_weights()
    streamed = [(n, t.clone()) for bucket in StreamingExporter(actor.model.bridge, actor.model.chunks,
                                                               bucket_bytes=50 * 1024).buckets() for n, t in bucket]
    out = {"export_equal": sorted(n for n, _ in streamed) == sorted(reference)
           and all(torch.equal(t, reference[n]) for n, t in streamed)}
    batch = actor.compute_log_prob(make_batch(8))
    out["engine_before"] = teacher_forced_log_probs(engine.model, batch)
    out["old_lp"], out["engine_lp"] = [], []
    for _ in range(2):
        with manager:
            out["engine_lp"].append(teacher_forced_log_probs(engine.model, batch))
        out["old_lp"].append(batch["old_log_probs"])
        actor.update_policy(batch)
        version.bump()
        batch = actor.compute_log_prob(batch)
    out["mask"] = batch["response_mask"]
    out["aux"] = {  # actor.moe router losses, same layout (see test_aux_loss_is_honoured_as_a_mean_over_tokens)
        "off": _aux_grad_norm(path, 0.0, 1, par, layout), "on": _aux_grad_norm(path, 0.1, 1, par, layout),
        "on_twice": _aux_grad_norm(path, 0.1, 2, par, layout),
    }
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    path = make_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("moe") / "qwen3_moe")
    return [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_body, 2, args=(str(path),))]


def test_engine_log_probs_match_the_ep2_actor_after_each_sync(runs):
    for rank, out in enumerate(runs):
        assert out["export_equal"], f"rank {rank}: streamed export differs from the bridge export"
        mask = out["mask"].bool()
        assert (out["engine_before"] - out["old_lp"][0])[mask].abs().max() > 1e-2  # other weights before the sync
        for step, (engine_lp, old_lp) in enumerate(zip(out["engine_lp"], out["old_lp"])):
            gap = (engine_lp - old_lp)[mask].abs().max().item()
            assert gap <= TOL, f"rank {rank} sync {step}: max |engine - actor| = {gap:.2e}"
        assert not torch.equal(out["old_lp"][0], out["old_lp"][1])  # the update moved the policy, then it synced


def test_aux_loss_is_honoured_as_a_mean_over_tokens(runs):
    """``actor.moe.aux_loss_coeff``: with zero advantages the load-balancing loss is the only gradient. It is zero
    with coefficient 0, non-zero with 0.1, and a mean over the mini-batch's tokens: the same rows twice over in
    one optimizer step (twice the tokens, each micro-batch twice) give the same gradient, not twice it."""
    for out in runs:
        aux = out["aux"]
        assert aux["off"] == 0.0
        assert aux["on"] > 1e-6
        assert aux["on_twice"] == pytest.approx(aux["on"], rel=1e-5)

