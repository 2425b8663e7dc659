"""Separate placement's weight sync: a Megatron actor on 2 trainer ranks (TP=2, then PP=2, tied embeddings) sends its
weights over the link to a transformers engine on a third rank, which starts from other random weights. After every
sync, before and after PPO updates, the engine's teacher-forced log-probs equal the trainer's within 1e-5 (fp32)."""

from __future__ import annotations

import io

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.sharding._fixtures import make_batch, save_checkpoint

TOL = 1e-5
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
SYNCS = 3  # per layout: the first weights, then after each of two updates


def _trainer(rank: int, links, split, path: str) -> dict:
    import megatron_patches
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.feed.streamed import LinkEngine, Remote
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.sharding.config import ShardingConfig
    from mcore_agentic.sharding.manager import ShardingManager
    from mcore_agentic.sharding.transports import WeightVersion
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig

    megatron_patches.apply()
    out: dict = {}
    for name, (tp, pp) in LAYOUTS.items():
        par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        layout = initialize_parallel(par, seed=1)
        cfg = ActorConfig(parallel=par, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                          optim=OptimConfig(lr=2e-2), policy_loss=PolicyLossConfig(entropy_coeff=0.0))
        actor = Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=4)
        engine = LinkEngine(Remote(links, split.engines)) if rank == 0 else None
        version = WeightVersion()
        manager = ShardingManager(actor, engine, ShardingConfig(bucket_size_mb=0.05), version=version)
        lps = []
        batch = make_batch(8)
        for sync in range(SYNCS):
            with manager:
                pass
            batch = actor.compute_log_prob(batch)
            lps.append(batch["old_log_probs"])
            if sync < SYNCS - 1:
                actor.update_policy(batch)
                version.bump()
        if engine is not None:
            engine.remote.sender.drain()  # the last version's buckets are sent on the link's thread
        out[name] = {"old_lp": lps, "bytes": engine.remote.sent_bytes if engine is not None else 0}
        del manager, actor
        destroy_parallel()
    return out


def _engine(links) -> dict:
    from mcore_agentic.feed import wire
    from mcore_agentic.rollout.engines.hf import HFEngine
    from tests.unit.sharding._fixtures import hf_config, random_model, teacher_forced_log_probs

    engine = HFEngine(random_model(hf_config(tied=True), seed=123))
    engine.resume_memory()
    batch = make_batch(8)
    out: dict = {"before": teacher_forced_log_probs(engine.model, batch)}
    for name in LAYOUTS:
        out[name] = {"lp": [], "versions": []}
        staged = []
        while len(out[name]["lp"]) < SYNCS:
            head = wire.recv_header(links, 0, up=False)
            if head[0] == wire.BUCKET:
                staged.append(wire.recv_bucket(links, head))
                continue
            assert head[0] == wire.WEIGHTS, head
            for bucket in staged:
                engine.update_weights(bucket, version=head[1])
            engine.finish_weight_update(head[1])
            staged = []
            out[name]["versions"].append(engine.weight_version)
            out[name]["lp"].append(teacher_forced_log_probs(engine.model, batch))
    return out


def _body(rank: int, world_size: int, path: str) -> bytes:
    from mcore_agentic.parallel.job import JobSplit, init_job

    split = JobSplit(world_size, rollout_ranks=1, rollout_tp=1, rank=rank)
    links = init_job(split, timeout_minutes=3)
    out = _engine(links) if split.is_rollout else _trainer(rank, links, split, path)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    path = save_checkpoint(tmp_path_factory.mktemp("link") / "qwen2", tied=True, seed=0)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_body, 3, args=(path,),
                                                                                     initialise=False)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_engine_holds_the_trainers_weights_after_every_sync(runs: list[dict], name: str) -> None:
    trainer0, trainer1, engine = runs
    # The trainer's log-probs come from its last pipeline stage: rank 1 under PP=2.
    old = trainer0[name]["old_lp"] if name == "tp2" else trainer1[name]["old_lp"]
    got = engine[name]["lp"]
    assert engine[name]["versions"] == list(range(SYNCS))
    assert (engine["before"] - old[0]).abs().max() > 0.1  # the engine started from other weights
    assert (old[1] - old[0]).abs().max() > 1e-3  # the updates moved the policy
    for sync in range(SYNCS):
        assert torch.allclose(got[sync], old[sync], atol=TOL, rtol=0), (name, sync, (got[sync] - old[sync]).abs().max())
    assert trainer0[name]["bytes"] > 0 and trainer1[name]["bytes"] == 0  # only the trainer's rank 0 sends
