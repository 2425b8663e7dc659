"""Weight sync from Megatron actors (TP=2 and PP=2 with tied embeddings, CP=2) into the transformers engine.

One spawned 2-rank gloo group runs the layouts one after the other (Megatron's parallel state is
torn down and rebuilt between them) and, per layout, every check:

- the engine starts from *other* random weights (its log-probs differ), and after each sync its
  teacher-forced log-probs equal the actor's old log-probs (before and after a PPO update);
- the streamed buckets equal the simple (unbucketed) bridge export bitwise, and the bytes the exporter holds stay within ``max(bucket, largest) + largest``;
- a twin actor that never syncs ends the same PPO updates with bitwise the same weights and
  optimizer state (offload of params, grads and optimizer on during the rollouts);
- the rollout's RNG stream is its own, and the training RNG is restored on exit;
- a trainer that updated without syncing gets ``StaleWeightsError``;

and a PP=2 x VP=2 export (4 tied layers) reproduces the HF checkpoint exactly.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.sharding._fixtures import make_batch, save_checkpoint

TOL = 1e-5


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    tied: bool = False


LAYOUTS = {"tp2_tied": Layout(tp=2, tied=True), "pp2_tied": Layout(pp=2, tied=True), "cp2": Layout(cp=2)}


def _state(model) -> list[torch.Tensor]:
    from mcore_agentic.workers.offload import model_param_tensors, optimizer_tensors

    return [t.detach().clone() for t in model_param_tensors(model.chunks) + optimizer_tensors(model.optimizer)]


def _export_checks(actor_model) -> dict:
    """Bucketed export == simple export (bitwise), and the exporter's live bytes stay bounded."""
    from mcore_agentic.sharding.exporter import LiveBytes, StreamingExporter

    reference = actor_model.export_hf_weights()
    out: dict = {"reference_names": sorted(reference)}
    for bucket_bytes in (48 * 1024, 200 * 1024):
        tracker = LiveBytes()
        exporter = StreamingExporter(actor_model.bridge, actor_model.chunks, bucket_bytes=bucket_bytes, tracker=tracker)
        names, equal, n_buckets = [], True, 0
        for bucket in exporter.buckets():
            n_buckets += 1
            for name, tensor in bucket:
                names.append(name)
                equal &= torch.equal(tensor, reference[name])
            del name, tensor
        largest = exporter.plan.largest_nbytes
        out[bucket_bytes] = dict(
            names=names, equal=equal, buckets=n_buckets, peak=tracker.peak, live_after=tracker.live,
            bound=max(bucket_bytes, largest) + largest, largest=largest,
        )
    return out


def _body(rank: int, world_size: int, paths: dict[str, str]) -> bytes:
    from mcore_agentic.parallel.layout import destroy_parallel

    out = {}
    for name, lay in LAYOUTS.items():
        start = time.perf_counter()
        out[name] = _layout_checks(paths[name], lay)
        out[name]["seconds"] = time.perf_counter() - start
        destroy_parallel()
    out["vpp"] = _virtual_pipeline_export(paths["vpp"])
    destroy_parallel()
    buf = io.BytesIO()
    torch.save(out, buf)  # bytes through the queue: no shared-memory tensors outliving the child
    return buf.getvalue()


def _virtual_pipeline_export(path: str) -> dict:
    """PP=2 x VP=2 (4 layers, tied): every streamed tensor equals the checkpoint's."""
    from mcore_agentic.models.hf_io import SafetensorsState, load_hf_config
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.sharding.exporter import StreamingExporter

    par = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    initialize_parallel(par, seed=1)
    config = load_hf_config(path)
    bridge = get_bridge(config)
    chunks = bridge.build_model(config, bridge.transformer_config(config, par))
    bridge.load_hf_weights(chunks, path)
    state = SafetensorsState(path)
    out = {"chunks": len(chunks), "expected": sorted(state)}
    exporter = StreamingExporter(bridge, chunks, bucket_bytes=40 * 1024)
    names, equal = [], True
    for bucket in exporter.buckets():
        for name, tensor in bucket:
            names.append(name)
            equal &= torch.equal(tensor, state[name])
    out["export"] = (names, equal)
    return out


def _layout_checks(path: str, lay: Layout) -> dict:
    import megatron_patches
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.rollout.engines.hf import HFEngine
    from mcore_agentic.sharding.config import ShardingConfig
    from mcore_agentic.sharding.manager import ShardingManager
    from mcore_agentic.sharding.transports import StaleWeightsError, WeightVersion
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig
    from tests.unit.sharding._fixtures import hf_config, random_model, teacher_forced_log_probs

    megatron_patches.apply()
    par = ParallelConfig(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                         context_parallel_size=lay.cp)
    layout = initialize_parallel(par, seed=1)
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                      optim=OptimConfig(lr=2e-2), policy_loss=PolicyLossConfig(entropy_coeff=0.0),
                      param_offload=True, grad_offload=True, optimizer_offload=True)
    actor = Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=4)
    twin = Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=4)  # never synced: the reference run
    engine = HFEngine(random_model(hf_config(tied=lay.tied), seed=123))
    version = WeightVersion()
    sharding = ShardingConfig(bucket_size_mb=0.1)
    manager = ShardingManager(actor, engine, sharding, version=version, rollout_seed=7)
    out: dict = {"export": _export_checks(actor.model)}

    batch = actor.compute_log_prob(make_batch(8))
    out["old_lp"] = [batch["old_log_probs"]]
    out["engine_before"] = teacher_forced_log_probs(engine.model, batch)
    out["engine_lp"], out["rollout_draws"], out["offloaded_in_rollout"] = [], [], []
    out["train_draw_ok"], out["same_state"] = [], []
    for step in range(2):
        torch.manual_seed(100 + step)
        with manager:
            out["engine_lp"].append(teacher_forced_log_probs(engine.model, batch))
            out["rollout_draws"].append(torch.rand(3))
            out["offloaded_in_rollout"].append(
                all(p.untyped_storage().nbytes() == 0 for c in actor.model.chunks for p in c.parameters())
            )
        out["engine_released"] = all(p.device.type == "meta" for p in engine.model.parameters())
        after = torch.rand(3)
        torch.manual_seed(100 + step)
        out["train_draw_ok"].append(torch.equal(after, torch.rand(3)))
        actor.update_policy(batch)
        twin.update_policy(batch)
        version.bump()
        out["same_state"].append(all(torch.equal(a, b) for a, b in zip(_state(actor.model), _state(twin.model))))
        batch = actor.compute_log_prob(batch)
        out["old_lp"].append(batch["old_log_probs"])
    out["versions"] = (engine.weight_version, version.value)
    try:  # the second update was never synced
        manager.check()
        out["stale"] = None
    except StaleWeightsError as exc:
        out["stale"] = str(exc)
    out["sync"] = manager.last_sync

    # A sync that fails (engine of another shape) leaves the actor trainable and the engine released.
    bad_config = hf_config(tied=lay.tied)
    bad_config.intermediate_size = 80
    bad_engine = HFEngine(random_model(bad_config, seed=5))
    before = _state(actor.model)
    try:
        with ShardingManager(actor, bad_engine, sharding, version=version):
            pass
        out["bad_error"] = None
    except ValueError as exc:
        out["bad_error"] = str(exc)
    out["bad_state_kept"] = all(torch.equal(a, b) for a, b in zip(before, _state(actor.model)))
    out["bad_engine_released"] = all(p.device.type == "meta" for p in bad_engine.model.parameters())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    paths = {
        name: save_checkpoint(tmp_path_factory.mktemp(name) / "qwen2", tied=lay.tied, seed=0)
        for name, lay in LAYOUTS.items()
    }
    paths["vpp"] = save_checkpoint(tmp_path_factory.mktemp("vpp") / "qwen2", tied=True, seed=5, layers=4)
    per_rank = [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_body, 2, args=(paths,))]
    return {name: [r[name] for r in per_rank] for name in [*LAYOUTS, "vpp"]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_engine_log_probs_match_actor_after_each_sync(runs, name):
    mask = make_batch(8)["attention_mask"][:, -8:].bool()
    for r in runs[name]:
        before = (r["engine_before"] - r["old_lp"][0])[mask].abs().max().item()
        assert before > 0.1, "engine started from the actor's weights: the sync would prove nothing"
        # engine_lp[0]: initial weights; engine_lp[1]: after one PPO update (which changed log-probs)
        assert (r["old_lp"][1] - r["old_lp"][0])[mask].abs().max().item() > 1e-3
        for step in range(2):
            assert (r["engine_lp"][step] - r["old_lp"][step]).abs().max().item() <= TOL, (name, step)
        assert r["engine_released"]
        assert r["sync"].buckets > 1 and r["sync"].version == 1


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_failed_sync_restores_actor_and_releases_engine(runs, name):
    for r in runs[name]:
        assert "mlp.gate_proj.weight" in r["bad_error"] and "shape" in r["bad_error"]
        assert r["bad_state_kept"] and r["bad_engine_released"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_continues_bitwise_as_without_sync(runs, name):
    for r in runs[name]:
        assert r["offloaded_in_rollout"] == [True, True]
        assert r["same_state"] == [True, True]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rollout_rng_is_separate_from_training_rng(runs, name):
    g = torch.Generator().manual_seed(7)
    expected = [torch.rand(3, generator=g), torch.rand(3, generator=g)]  # one stream across rollouts
    for r in runs[name]:
        assert r["train_draw_ok"] == [True, True]
        for got, want in zip(r["rollout_draws"], expected):
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_streamed_export_is_exact_and_memory_bounded(runs, name):
    for r in runs[name]:
        ex = r["export"]
        for key, res in ex.items():
            if key == "reference_names":
                continue
            assert sorted(res["names"]) == ex["reference_names"] and len(res["names"]) == len(set(res["names"])), key
            assert res["equal"], key
            assert res["buckets"] > 1, key
            # c10d's gloo worker may still hold the last collective's buffer (one tensor) until its next op.
            assert res["live_after"] <= res["largest"], key
            assert res["largest"] <= res["peak"] <= res["bound"], (key, res["peak"], res["bound"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stale_engine_is_an_error(runs, name):
    for r in runs[name]:
        assert r["versions"] == (1, 2)
        assert "weight version 1" in r["stale"] and "version 2" in r["stale"]


def test_virtual_pipeline_export_equals_checkpoint(runs):
    for r in runs["vpp"]:
        assert r["chunks"] == 2
        names, equal = r["export"]
        assert sorted(names) == r["expected"] and equal
