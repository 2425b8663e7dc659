"""Routing replay (``actor.moe.routing_replay``) on a tiny Qwen3-MoE with its experts over 2 gloo ranks (EP=2).

The rollout engine runs in bfloat16 and records its routers' top-k per token; the actor runs in fp32. Without
replay some tokens' routers choose other experts than the engine's (``rollout/routing_agreement`` < 1); with
replay every router of the old-log-prob forward *and* of the update forwards routes each token the engine fed to
exactly the recorded experts (checked per token and layer on the routing maps), and the tokens it never fed (the
last sampled one, padding) keep their own. At PP=2 (each stage replaying its own layers of the record) the replayed
log-probs are the EP=2 ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import make_tiny_hf


def _rollout(path: str, prompts: list[list[int]]):
    """The engine's samples as rollout rows with ``routed_experts`` (bf16 engine, recorded routing)."""
    from mcore_agentic.rollout.driver import sample_rows
    from mcore_agentic.rollout.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(path, dtype=torch.bfloat16, record_routing=True)
    return asyncio.run(sample_rows(engine, prompts, max_new_tokens=12))


def _body(rank: int, world_size: int, path: str) -> bytes:
    from megatron.core.transformer.moe.router import TopKRouter

    import megatron_patches
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, MoEConfig, OptimConfig

    megatron_patches.apply()
    par = ParallelConfig(expert_model_parallel_size=2)
    layout = initialize_parallel(par, seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 200, (int(n),), generator=g).tolist() for n in torch.randint(4, 14, (8,), generator=g)]
    full = _rollout(path, prompts)  # every rank samples the same rows (same seeds): the actor's DP share is its half
    batch = full.index(range(4 * rank, 4 * rank + 4))
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, shuffle=False,
                      optim=OptimConfig(lr=1e-2), policy_loss=PolicyLossConfig(entropy_coeff=0.0),
                      moe=MoEConfig(routing_replay="rollout"))
    actor = Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=8)
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (routing map, the target it was given)

    def keep(module, args, output):
        seen.append((output[1].detach().clone(), None if module.router_replay.target is None
                     else module.router_replay.target.clone()))

    for chunk in actor.model.chunks:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(keep)
    routing = actor.model.routing
    out: dict = {}
    with routing.use(replay=False, measure=True):  # measure only: the trainer's own routing
        free = actor.model.forward_only(batch, _head(actor), actor.batching)["log_probs"]
    out["agreement_free"] = actor.routing_metrics()
    out["free"], seen[:] = list(seen), []
    replayed = actor.compute_log_prob(batch)  # actor.moe.routing_replay=rollout: replay + measure
    out["agreement_replay_pass"] = actor.routing_metrics()
    out["replay"], seen[:] = list(seen), []
    actor.update_policy(replayed.update({"advantages": torch.randn(replayed["response_mask"].shape) *
                                         replayed["response_mask"]}))
    out["update"] = list(seen)
    mask = batch["response_mask"].bool()
    out["gap_free"] = (free - batch["rollout_log_probs"])[mask].abs()
    out["gap_replay"] = (replayed["old_log_probs"] - batch["rollout_log_probs"])[mask].abs()
    out["ep_replay"], out["ep_free"] = replayed["old_log_probs"], free
    # PP=2: each stage's routers are other layers of the record (layer 1 on stage 0, layer 2 on stage 1).
    destroy_parallel()
    par = ParallelConfig(pipeline_model_parallel_size=2)
    layout = initialize_parallel(par, seed=1)
    actor = Actor(dataclasses.replace(cfg, parallel=par), ModelSpec(path, "float32", parallel=par), layout,
                  mini_batch_sequences=8)
    out["pp_replay"] = actor.compute_log_prob(full)["old_log_probs"]
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _head(actor):
    from mcore_agentic.workers.passes import log_prob_head

    return log_prob_head(actor.model, 1.0, False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    path = make_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("replay") / "qwen3_moe")
    return [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_body, 2, args=(str(path),))]


def _routed(routing_map: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """(tokens the engine fed, those whose routed experts are exactly the engine's)."""
    known = (target >= 0).all(-1)
    chosen = torch.zeros_like(routing_map).scatter_(1, target.clamp(min=0), True)
    exact = (routing_map == chosen).all(-1) & known
    return int(known.sum()), int(exact.sum())


def test_a_bf16_engine_routes_some_tokens_elsewhere_than_the_fp32_trainer(runs):
    for out in runs:
        agreement = out["agreement_free"]["rollout/routing_agreement"]
        assert 0.5 < agreement < 1.0, agreement
        fed = differ = 0
        for routing_map, target in out["free"]:
            known, exact = _routed(routing_map, target)
            fed, differ = fed + known, differ + known - exact
        assert differ > 0 and fed > 100
        assert agreement == pytest.approx(1 - differ / fed, abs=0.05)  # both ranks' tokens vs this rank's


def test_replay_routes_every_fed_token_to_the_recorded_experts_in_both_passes(runs):
    for out in runs:
        # measured against the router's own choice (replay moves later layers' inputs toward the engine's)
        assert 0.5 < out["agreement_replay_pass"]["rollout/routing_agreement"] <= 1.0
        for name in ("replay", "update"):
            calls = out[name]
            assert calls and all(t is not None for _, t in calls), name
            for routing_map, target in calls:
                known, exact = _routed(routing_map, target)
                assert known > 0 and exact == known, f"{name}: {known - exact} of {known} tokens routed elsewhere"
                # tokens the engine never fed (the last sampled one, padding) keep their own top-2
                assert bool((routing_map[~(target >= 0).all(-1)].sum(-1) == 2).all())
        assert len(out["update"]) == len(out["replay"])  # one optimizer step over the same micro-batches


def test_replay_at_pp2_gives_the_ep2_log_probs(runs):
    full = runs[0]["pp_replay"]
    assert torch.equal(full, runs[1]["pp_replay"])  # broadcast from the last stage
    for rank, out in enumerate(runs):
        mine = full[4 * rank : 4 * rank + 4]
        assert (mine - out["ep_replay"]).abs().max() <= 1e-5
    # and replay mattered: some token's log-prob differs from the trainer's own routing's
    assert max(float((out["ep_replay"] - out["ep_free"]).abs().max()) for out in runs) > 1e-3
