"""With the patches applied, a tiny GPTModel (local spec, fp32) trains on 2 gloo ranks:
forward+backward at TP=2, the pipeline schedule at PP=2 (2 microbatches), and a DDP +
distributed-optimizer step with grad clipping."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import megatron_patches
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches import _tiny_gpt as T


def _loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()  # per-token CE from GPTModel (labels given) -> mean
    return loss, {"loss": loss.detach()}


def _train_step(tp: int, pp: int) -> dict[str, Any]:
    """One step: DDP(distributed optimizer) + forward_backward schedule (2 microbatches) + Adam with clipping."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel_state.destroy_model_parallel()
    T.init_parallel(tp=tp, pp=pp)
    config = T.transformer_config()
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        T.build_gpt(config),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.5, use_distributed_optimizer=True, params_dtype=torch.float32),
        [model],
    )
    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    batches = iter([T.batch(seed=i) for i in range(2)])

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        return model(b["tokens"], b["position_ids"], None, labels=b["labels"]), _loss

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[model],
        num_microbatches=2,
        seq_length=T.SEQ,
        micro_batch_size=2,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    changed = {n: not torch.equal(p.detach(), before[n]) for n, p in model.module.named_parameters()}
    return {"losses": [float(x["loss"]) for x in losses], "ok": ok, "grad_norm": grad_norm, "changed": changed}


def _tp2_forward_backward() -> dict[str, Any]:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    T.init_parallel(tp=2)
    model = T.build_gpt(T.transformer_config())
    b = T.batch()
    loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean()
    loss.backward()
    grads = {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in model.named_parameters()}
    return {"loss": float(loss), "grads": grads}


def _body(rank: int, world_size: int) -> bytes:
    from megatron.core import parallel_state

    megatron_patches.apply()
    out = {"tp2": _tp2_forward_backward(), "tp2_step": _train_step(tp=2, pp=1), "pp2_step": _train_step(tp=1, pp=2)}
    parallel_state.destroy_model_parallel()
    return T.pack(out)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return [T.unpack(r) for r in run_distributed(_body, 2)]


def test_tp2_forward_backward(results):
    r0, r1 = results[0]["tp2"], results[1]["tp2"]
    assert r0["loss"] == pytest.approx(r1["loss"], rel=1e-6)  # TP ranks see the same (all-reduced) loss
    assert 3.0 < r0["loss"] < 5.5  # ~ln(64) for a random init
    for rank_grads in (r0["grads"], r1["grads"]):
        assert all(rank_grads.values()), f"missing/zero grads: {[n for n, ok in rank_grads.items() if not ok]}"


@pytest.mark.parametrize("layout", ["tp2_step", "pp2_step"])
def test_train_step_updates_every_parameter(results, layout):
    for rank, res in enumerate(results):
        step = res[layout]
        assert step["ok"], f"rank {rank}: optimizer step skipped"
        assert step["grad_norm"] > 0 and step["grad_norm"] == pytest.approx(results[0][layout]["grad_norm"])
        assert step["changed"] and all(step["changed"].values()), f"rank {rank}: unchanged {step['changed']}"


def test_pp2_schedule_runs_two_microbatches(results):
    # The last pipeline stage reports one loss per microbatch; the first reports none.
    assert results[0]["pp2_step"]["losses"] == []
    assert len(results[1]["pp2_step"]["losses"]) == 2
