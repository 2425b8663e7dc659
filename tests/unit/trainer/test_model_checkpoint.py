"""Megatron dist checkpoints of actor/critic + optimizer + LR schedule, resumed at the same and at another TP.

Two spawned 2-rank process groups:

* ``save``, first at TP=2 (actor), then at TP=1 / DP=2 (actor and critic): the workers
  update on batch 1, are saved through the checkpoint manager, then update on batch 2
  (the uninterrupted runs);
* ``load`` at TP=1 (DP=2), a fresh process group whose workers start from *different*
  HF weights: each checkpoint is loaded and the batch-2 update is run again.

The LR schedule warms up (so a lost scheduler state changes the step size), Adam
moments matter after one update, and the mini-batch shuffle is seeded by the update
counter: the resumed update can only match when all of them were restored.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tests.helpers.critic import critic_weights
from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import make_batch, make_tiny_hf, setup_rank

REL_TOL = 1e-5
CROSS_TP_TOL = 5e-5
"""A resume at another TP sums each matmul's shards in another order (fp32 rounding), and Adam normalises every
element's update, so an element whose gradient is near zero moves by its rounding, not its size: measured 1.2e-5
of the largest weight on one AVX-512 machine (below 1e-5 on others). Still 20x below the update itself (> 1e-3)."""


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _workers(path: str, par, layout, with_critic: bool, **optim_overrides):
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, CriticConfig, OptimConfig
    from mcore_agentic.workers.critic import Critic

    # Warmup 3 of 10 optimizer steps (2 per update): the LR still changes at the resumed update.
    optim = OptimConfig(**{"lr": 5e-3, "lr_warmup_steps": 3, "total_training_steps": 10, "lr_decay_style": "cosine",
                           "clip_grad": 1.0, **optim_overrides})
    actor_cfg = ActorConfig(
        parallel=par, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=optim,
        policy_loss=PolicyLossConfig(entropy_coeff=0.01),
    )
    spec = ModelSpec(path, "float32", parallel=par)
    actor = Actor(actor_cfg, spec, layout, mini_batch_sequences=4)  # ppo_mini_batch_size sequences (no rollout.n here)
    critic = None
    if with_critic:
        critic_cfg = CriticConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=optim)
        critic = Critic(critic_cfg, spec, layout, mini_batch_sequences=4)
    return actor, critic


def _update(actor, critic, seed: int) -> None:
    from mcore_agentic.feed.distribute import deal_rows

    # Each DP replica trains its share, dealt as the trainer deals it (mini-batches of 4 rows).
    full = make_batch(8, seed=seed)
    layout = actor.model.layout
    rows = deal_rows(full["attention_mask"].sum(1).tolist(), chunk=4, dp=layout.data_parallel_size, seed=None)
    batch = actor.compute_log_prob(full.index(rows[layout.dp_rank]))
    actor.update_policy(batch)
    if critic is not None:
        critic.update_critic(critic.compute_values(batch))


def _snapshot(actor, critic) -> dict:
    out = {"actor": actor.export_hf_weights(), "lr": actor.model.optimizer.param_groups[0]["lr"]}
    if critic is not None:
        out["critic"] = critic_weights(critic)
    return out


def _save_body(rank: int, world_size: int, path: str, roots: dict) -> bytes:
    from mcore_agentic.parallel.layout import destroy_parallel
    from mcore_agentic.trainer.checkpoint import CheckpointManager
    from mcore_agentic.trainer.model_checkpoint import model_state_writers

    out = {}
    for name, tp, with_critic in (("tp2", 2, False), ("tp1", 1, True)):  # one process group, two layouts
        actor, critic = _workers(path, *setup_rank(tp), with_critic)
        _update(actor, critic, seed=1)
        writers = model_state_writers(actor=actor, critic=critic)
        if tp == 1:  # colocated mode: a save may find the actor offloaded; it stays offloaded
            actor.model.offload()
        CheckpointManager(roots[name]).save(1, {"step": 1}, writers=writers)
        if tp == 1:
            assert all(actor.model.offloader.is_offloaded(g) for g in ("params", "grads", "optimizer"))
            actor.model.reload()
        saved = _snapshot(actor, critic)
        _update(actor, critic, seed=2)
        out[name] = {"saved": saved, "next": _snapshot(actor, critic)}
        del actor, critic, writers
        destroy_parallel()
    return _to_bytes(out)


def _load_body(rank: int, world_size: int, other_path: str, roots: dict) -> bytes:
    import torch.distributed as dist

    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.trainer.checkpoint import CheckpointManager
    from mcore_agentic.trainer.model_checkpoint import load_worker, model_state_readers, save_worker
    from mcore_agentic.workers.megatron_model import MegatronModel

    out = {}
    par, layout = setup_rank(1)
    for name in ("tp1", "tp2"):
        root = roots[name]
        with_critic = name == "tp1"
        actor, critic = _workers(other_path, par, layout, with_critic)
        before = actor.export_hf_weights()
        mgr = CheckpointManager(root)
        if with_critic:  # loading into an offloaded worker: the loaded state is what comes back on reload
            critic.model.offload()
        loaded = mgr.load(mgr.latest(), readers=model_state_readers(actor=actor, critic=critic))
        if with_critic:
            assert critic.model.offloader.is_offloaded("params")
            critic.model.reload()
        assert loaded.global_step == 1
        res = {"before": before, "loaded": _snapshot(actor, critic), "updates": actor._updates}
        _update(actor, critic, seed=2)
        res["next"] = _snapshot(actor, critic)
        out[name] = res
        del actor, critic

    # Weights only, into a frozen model (no optimizer), as an HF export from a checkpoint does.
    frozen = MegatronModel(ModelSpec(other_path, "float32", parallel=par), layout, optim=None)
    load_worker(Path(roots["tp2"]) / "global_step_1" / "actor", frozen)
    out["frozen_tp2"] = frozen.export_hf_weights()
    # A weights-only checkpoint cannot resume a trainable worker: a clear error, raised on every rank
    # before any collective (only the common state was read).
    weights_only = Path(roots["tp1"]).parent / "weights_only"
    if rank == 0:
        weights_only.mkdir()
    dist.barrier()
    save_worker(weights_only, frozen)
    actor, _ = _workers(other_path, par, layout, False)
    try:
        load_worker(weights_only, actor)
        out["weights_only_error"] = None
    except ValueError as e:
        out["weights_only_error"] = str(e)
    load_worker(weights_only, actor, load_optimizer=False)
    out["weights_only_into_actor"] = _equal(actor.export_hf_weights(), out["frozen_tp2"])
    # trainer.resume_optim_from: a changed lr / eps keeps the checkpoint's values, or this run's.
    for optim_from in ("checkpoint", "config"):
        actor, _ = _workers(other_path, par, layout, False, lr=2e-2, eps=1e-5)
        load_worker(Path(roots["tp1"]) / "global_step_1" / "actor", actor, optim_from=optim_from)
        sched = actor.model.scheduler
        groups = actor.model.optimizer.param_groups
        out[f"optim_from_{optim_from}"] = {
            "max_lr": sched.max_lr, "num_steps": sched.num_steps, "eps": sorted({g["eps"] for g in groups}),
            "lr": sorted({g["lr"] for g in groups}),  # what the next step uses
        }
        del actor
    return _to_bytes(out)


def _load(blobs: list[bytes]) -> list[dict]:
    return [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("ckpt")
    path = str(make_tiny_hf(base / "hf0", seed=0))
    other = str(make_tiny_hf(base / "hf1", seed=1))
    roots = {"tp1": str(base / "run_tp1"), "tp2": str(base / "run_tp2")}
    per_rank = _load(run_distributed(_save_body, 2, (path, roots)))
    saves = {name: [r[name] for r in per_rank] for name in roots}
    loads = _load(run_distributed(_load_body, 2, (other, roots)))
    return {"saves": saves, "loads": loads, "roots": roots}


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in b)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_checkpoint_layout_on_disk(runs):
    for root in runs["roots"].values():
        step = Path(root) / "global_step_1"
        assert (step / "COMPLETE").is_file()
        assert (step / "actor" / "metadata.json").is_file()  # a torch_dist checkpoint
    assert (Path(runs["roots"]["tp1"]) / "global_step_1" / "critic" / "metadata.json").is_file()


def test_save_tp2_load_tp1_reproduces_the_weights(runs):
    """Issue 2's acceptance: a TP=2 dist checkpoint loads at TP=1 (DP=2) into the same HF weights."""
    for rank in range(2):
        got = runs["loads"][rank]["tp2"]
        saved = runs["saves"]["tp2"][0]["saved"]
        assert not _equal(got["before"], saved["actor"])  # the loading run started elsewhere
        assert _equal(got["loaded"]["actor"], saved["actor"])


def test_weights_only_load_into_frozen_model_and_clear_error(runs):
    saved = runs["saves"]["tp2"][0]["saved"]["actor"]
    for r in runs["loads"]:
        assert _equal(r["frozen_tp2"], saved)
        assert r["weights_only_error"] is not None and "load_optimizer=False" in r["weights_only_error"]
        assert r["weights_only_into_actor"]


def test_resume_same_tp_is_bitwise(runs):
    """Model, optimizer, LR schedule and update counter restored: the next update is bit-identical."""
    saved = runs["saves"]["tp1"][0]
    for rank in range(2):
        got = runs["loads"][rank]["tp1"]
        assert got["updates"] == 1
        assert got["loaded"]["lr"] == saved["saved"]["lr"]
        assert _equal(got["loaded"]["actor"], saved["saved"]["actor"])
        assert _equal(got["loaded"]["critic"], saved["saved"]["critic"])
        assert _equal(got["next"]["actor"], saved["next"]["actor"])
        assert _equal(got["next"]["critic"], saved["next"]["critic"])
        assert got["next"]["lr"] == saved["next"]["lr"]
    # The resumed update really moved the weights (and by more than any tolerance used here).
    assert _max_rel(saved["next"]["actor"], saved["saved"]["actor"]) > 1e-3


def test_resume_with_different_tp_matches_uninterrupted_run(runs):
    """Saved at TP=2 with optimizer state, resumed at TP=1 (DP=2): the next update matches TP=2's."""
    saved = runs["saves"]["tp2"][0]
    for rank in range(2):
        got = runs["loads"][rank]["tp2"]
        assert got["next"]["lr"] == saved["next"]["lr"]
        assert _max_rel(got["next"]["actor"], saved["next"]["actor"]) <= CROSS_TP_TOL
    assert _max_rel(saved["next"]["actor"], saved["saved"]["actor"]) > 1e-3


def test_resume_optim_from_picks_whose_settings_win(runs):
    """trainer.resume_optim_from: the saved schedule and Adam settings (default), or this run's from the saved step."""
    for rank in runs["loads"]:
        kept, mine = rank["optim_from_checkpoint"], rank["optim_from_config"]
        assert kept["max_lr"] == 5e-3 and kept["eps"] == [1e-8]
        assert mine["max_lr"] == 2e-2 and mine["eps"] == [1e-5]
        assert kept["num_steps"] == mine["num_steps"] == 2  # the schedule continues from the saved step either way
        # The step size itself follows (warm-up 2 of 3 steps): 2/3 of whichever peak learning rate won.
        assert kept["lr"] == [pytest.approx(5e-3 * 2 / 3)] and mine["lr"] == [pytest.approx(2e-2 * 2 / 3)]


def test_load_errors_are_clear(tmp_path):
    from mcore_agentic.trainer.model_checkpoint import load_worker

    class _Model:
        chunks: list = []
        optimizer = None

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_worker(tmp_path / "missing", _Model())
    with pytest.raises(TypeError, match="MegatronModel"):
        load_worker(tmp_path, object())


def test_reference_is_checkpointed_weights_only(monkeypatch):
    from mcore_agentic.trainer import model_checkpoint as mc

    calls = []
    monkeypatch.setattr(mc, "load_worker", lambda d, w, load_optimizer=True, optim_from="checkpoint": calls.append((d, w, load_optimizer)))
    actor, ref = object(), object()
    assert sorted(mc.model_state_writers(actor=actor, ref=ref)) == ["actor", "ref"]
    readers = mc.model_state_readers(actor=actor, ref=ref)
    readers["actor"]("a")
    readers["ref"]("r")
    assert calls == [("a", actor, True), ("r", ref, False)]  # the anchor has no optimizer state to restore


def test_load_refuses_without_the_checkpoint_patches(tmp_path, monkeypatch):
    """Weights-only byte entries and the torch-Adam optimizer load are megatron_patches: no load without them."""
    import sys

    import megatron_patches
    from mcore_agentic.trainer.model_checkpoint import load_worker

    class _Model:
        chunks: list = []
        optimizer = None

    monkeypatch.setattr(megatron_patches, "applied", lambda: ("rng_tracker", "distopt_load_unstepped"))
    with pytest.raises(RuntimeError, match=r"megatron_patches\.apply\(\) first \(not applied: dist_checkpointing_weights_only, "
                       r"distopt_load_step_key, distopt_load_shared_step\)"):
        load_worker(tmp_path, _Model())
    monkeypatch.delitem(sys.modules, "megatron_patches")
    with pytest.raises(RuntimeError, match=r"megatron_patches\.apply\(\) first"):
        load_worker(tmp_path, _Model())
