"""``model.dtype=float16`` trains with its loss scaled: the schedule multiplies each micro-batch's loss by the dynamic
loss scale (``grad_scale_func``) that the optimizer divides back out, so an fp16 update's gradient is the fp32
update's, not 2^-16 of it (GPU review W1: the scale was never applied and the update collapsed by ~100x under Adam's
epsilon). On CPU, fp16 matmuls run in torch 2.13: a tiny actor in fp16 and in fp32 take one PPO step from the same
weights on the same rows; the gradient norms must agree to fp16's precision."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

LENGTHS = [20, 7, 12, 3]


def _grad_norm(path: str, dtype: str) -> dict[str, float]:
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig
    from tests.unit.workers._fixtures import make_batch

    par = ParallelConfig()
    layout = initialize_parallel(par, 1)
    n = len(LENGTHS)
    actor = Actor(ActorConfig(parallel=par, ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=n,
                              optim=OptimConfig(lr=1e-4, clip_grad=0.0)),
                  ModelSpec(path, dtype, parallel=par), layout, mini_batch_sequences=n)
    model = actor.model
    scaled = model.tcfg.grad_scale_func is not None and model.tcfg.grad_scale_func == model.optimizer.scale_loss
    batch = actor.compute_log_prob(make_batch(n, response_lengths=LENGTHS))
    metrics = actor.update_policy(batch)
    out = {"grad_norm": metrics["grad_norm"], "scaled": float(scaled),
           "loss_scale": float(model.optimizer.get_loss_scale().item()) if dtype == "float16" else 1.0}
    destroy_parallel()
    return out


def _body(rank: int, world_size: int, path: str) -> dict[str, dict[str, float]]:
    import megatron_patches

    megatron_patches.apply()
    return {dtype: _grad_norm(path, dtype) for dtype in ("float32", "float16")}


@pytest.fixture(scope="module")
def norms(tmp_path_factory) -> dict[str, dict[str, float]]:
    from tests.unit.workers._fixtures import make_tiny_hf

    path = make_tiny_hf(tmp_path_factory.mktemp("fp16") / "tiny")
    return run_distributed(_body, 1, args=(str(path),))[0]


def test_fp16_update_gradient_equals_the_fp32_one(norms):
    fp32, fp16 = norms["float32"], norms["float16"]
    assert fp32["grad_norm"] > 0
    assert fp16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.05)  # unscaled: 2^-16 of it
    assert fp16["scaled"] == 1.0 and fp32["scaled"] == 0.0  # only fp16 scales its loss
    assert fp16["loss_scale"] == 2.0**16  # no overflow, no back-off on the first step
