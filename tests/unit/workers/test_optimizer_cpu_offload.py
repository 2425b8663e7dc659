"""``actor.optim.optimizer_cpu_offload``: megatron-core's hybrid device optimizer keeps Adam on the host and its updates
are the device optimizer's.

One spawned 2-rank group (DP=2, so each rank's optimizer owns half of every buffer). On each rank a tiny bf16 actor
takes three PPO updates from the same weights on the same rows, once with the plain distributed optimizer and once
with each offload setting (everything on the host, fraction 1.0; half, 0.5). The hybrid optimizer's fp32 masters
(host copies, and for the device share its own fp32 copies) equal the distributed optimizer's fp32 main params
within 1e-6 after every update, the gradient norms agree, and so do the bf16 parameters cast from them.
(An fp32 model is refused: its shards are views of its parameters, which torch will not optimise.)

Then the offloaded actor's checkpoint (its optimizer state gathered from the host copies) loads into a fresh
offloaded actor, whose next update equals the uninterrupted one: the hybrid optimizer's state round-trips.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import make_batch, make_tiny_hf

LENGTHS = [20, 7, 12, 3, 9, 15, 4, 11]
UPDATES = 3


def _actor(path: str, dtype: str, **offload):
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig

    par = ParallelConfig()
    layout = initialize_parallel(par, 2)
    n = len(LENGTHS) // 2
    optim = OptimConfig(lr=5e-3, lr_warmup_steps=0, clip_grad=1.0, **offload)
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=2 * n, ppo_micro_batch_size_per_gpu=2, optim=optim)
    return Actor(cfg, ModelSpec(path, dtype, parallel=par), layout, mini_batch_sequences=2 * n)


def _params(actor) -> list:
    return [p.detach().float().clone() for chunk in actor.model.chunks for p in chunk.parameters()]


def _distributed(actor) -> list:
    """The distributed optimizers (megatron chains one per parameter-group kind)."""
    opt = actor.model.optimizer
    return list(getattr(opt, "chained_optimizers", [opt]))


def _masters(actor) -> list:
    """This rank's fp32 master shards, in the distributed optimizers' order."""
    out = []
    for dist_opt in _distributed(actor):
        inner = dist_opt.optimizer
        if type(inner).__name__ == "HybridDeviceOptimizer":
            out += [inner.param_to_inner_param[p].detach().clone() for g in inner.param_groups for p in g["params"]]
        else:
            out += [p.detach().clone() for g in dist_opt.shard_fp32_from_float16_groups for p in g]
    return out


def _rows(rank: int, step: int):
    n = len(LENGTHS) // 2
    return make_batch(n, seed=10 * step + rank, response_lengths=LENGTHS[rank * n:(rank + 1) * n])


def _run(path: str, dtype: str, rank: int, ckpt: str | None = None, **offload) -> dict:
    from mcore_agentic.parallel.layout import destroy_parallel
    from mcore_agentic.trainer.model_checkpoint import save_worker

    actor = _actor(path, dtype, **offload)
    inners = [d.optimizer for d in _distributed(actor)]
    facts = {"optimizer": sorted({type(inner).__name__ for inner in inners})}
    if offload:
        facts["host_optimizers"] = sum(len(inner.cpu_optimizers) for inner in inners)
        facts["device_optimizer"] = any(inner.gpu_optimizer is not None for inner in inners)
        model_storages = {p.untyped_storage().data_ptr() for chunk in actor.model.chunks for p in chunk.parameters()}
        copies = [p for inner in inners for opt in inner.cpu_optimizers for g in opt.param_groups for p in g["params"]]
        facts["host_copies_share_model_storage"] = any(
            p.untyped_storage().data_ptr() in model_storages for p in copies)
        facts["host_copy_dtypes"] = sorted({str(p.dtype) for p in copies})
    params, masters, norms = [], [], []
    for step in range(UPDATES):
        if ckpt is not None and step == UPDATES - 1:
            save_worker(ckpt, actor)
        batch = actor.compute_log_prob(_rows(rank, step))
        norms.append(actor.update_policy(batch)["grad_norm"])
        params.append(_params(actor))
        masters.append(_masters(actor))
    destroy_parallel()
    return {"params": params, "masters": masters, "norms": norms, **facts}


def _resumed(path: str, dtype: str, rank: int, ckpt: str, **offload) -> dict:
    from mcore_agentic.parallel.layout import destroy_parallel
    from mcore_agentic.trainer.model_checkpoint import load_worker

    actor = _actor(path, dtype, **offload)
    load_worker(ckpt, actor)
    batch = actor.compute_log_prob(_rows(rank, UPDATES - 1))
    norm = actor.update_policy(batch)["grad_norm"]
    out = {"params": _params(actor), "masters": _masters(actor), "norm": norm}
    destroy_parallel()
    return out


def _body(rank: int, world_size: int, path: str, ckpt: str) -> dict:
    import megatron_patches

    megatron_patches.apply()
    host_all = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    host_half = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    return {
        "device": _run(path, "bfloat16", rank),
        "host": _run(path, "bfloat16", rank, ckpt=ckpt, **host_all),
        "resumed": _resumed(path, "bfloat16", rank, ckpt, **host_all),
        "half": _run(path, "bfloat16", rank, **host_half),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("host_optimizer")
    path = make_tiny_hf(tmp / "tiny")
    (tmp / "ckpt").mkdir()
    return run_distributed(_body, 2, args=(str(path), str(tmp / "ckpt")))


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_the_hybrid_optimizer_keeps_separate_host_copies(runs):
    for out in runs:
        assert out["device"]["optimizer"] == ["AdamW"]
        host = out["host"]
        assert host["optimizer"] == ["HybridDeviceOptimizer"]
        assert host["host_optimizers"] >= 1 and not host["device_optimizer"]
        assert not host["host_copies_share_model_storage"]
        assert host["host_copy_dtypes"] == ["torch.float32"]  # fp32 masters of the bf16 shards
        half = out["half"]
        assert half["host_optimizers"] >= 1 and half["device_optimizer"]  # the split: some on each side


@pytest.mark.parametrize("setting", ["host", "half"])
def test_updates_with_the_optimizer_on_the_host_equal_the_device_optimizer(runs, setting):
    for out in runs:
        ref, run = out["device"], out[setting]
        assert ref["norms"][0] > 0
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for step in range(UPDATES):
            assert _max_diff(ref["masters"][step], run["masters"][step]) <= 1e-6, step
            assert _max_diff(ref["params"][step], run["params"][step]) <= _bf16_step(ref["params"][step]), step
        assert _max_diff(ref["masters"][-1], ref["masters"][0]) > 1e-3  # the updates moved the weights


def _bf16_step(params: list) -> float:
    """One bf16 rounding step of the largest weight: masters equal to 1e-6 may still round apart once."""
    return max(float(p.abs().max()) for p in params) * 2**-7


def test_a_checkpoint_of_the_host_optimizer_resumes_the_same_update(runs):
    for out in runs:
        resumed, uninterrupted = out["resumed"], out["host"]
        assert resumed["norm"] == pytest.approx(uninterrupted["norms"][-1], rel=1e-5)
        assert _max_diff(resumed["masters"], uninterrupted["masters"][-1]) <= 1e-6
        assert _max_diff(resumed["params"], uninterrupted["params"][-1]) == 0
