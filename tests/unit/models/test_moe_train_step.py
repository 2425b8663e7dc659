"""One MoE training step (Qwen3-MoE, 8 experts, top-2, the switch load-balancing loss on) at EP=2 equals EP=1
(DP=2 both): the same loss, grad norm and updated weights within 1e-5 relative, compared as full HF-named
tensors. At EP=2 each rank holds 4 experts and tokens cross ranks by all-to-all in forward and backward.
The trained EP=2 model saved as a Megatron distributed checkpoint loads at EP=1 bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack
from tests.unit.models._hf_fixtures import make_tiny_hf
from tests.unit.models._megatron_step import build_trainable, export, train_step

LAYOUTS = {"ep1": ParallelConfig(), "ep2": ParallelConfig(expert_model_parallel_size=2)}
RTOL = 1e-5
AUX = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}


def _body(rank: int, world_size: int, path: str, ckpt_dir: str) -> bytes:
    from megatron.core import dist_checkpointing

    import megatron_patches
    from mcore_agentic.parallel.layout import destroy_parallel
    from tests.helpers.hf import load_hf_state_dict

    megatron_patches.apply()
    out: dict[str, Any] = {"initial": load_hf_state_dict(path)}
    for name, par in LAYOUTS.items():
        trainable = build_trainable(par, path, **AUX)
        out[name] = train_step(trainable)
        out[name]["weights"] = export(trainable)
        if name == "ep2":  # the trained EP=2 model as a Megatron distributed checkpoint
            dist_checkpointing.save(trainable.chunks[0].sharded_state_dict(), ckpt_dir)
        destroy_parallel()
    # Resumed at EP=1 from the untrained weights: the checkpoint must supply every expert.
    trainable = build_trainable(LAYOUTS["ep1"], path, **AUX)
    chunk = trainable.chunks[0]
    chunk.load_state_dict(dist_checkpointing.load(chunk.sharded_state_dict(), ckpt_dir))
    out["loaded_at_ep1"] = export(trainable)
    destroy_parallel()
    return pack(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("moe")
    path = make_tiny_hf("Qwen3MoeForCausalLM", root / "qwen3_moe")
    (root / "ckpt").mkdir()
    return [unpack(r) for r in run_distributed(_body, 2, args=(str(path), str(root / "ckpt")))]


def test_ep2_step_equals_ep1(results):
    ref = results[0]["ep1"]
    assert ref["ok"] and ref["grad_norm"] > 0
    for res in results:
        assert res["ep2"]["ok"]
        assert res["ep2"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL)
        assert res["ep2"]["losses"] == pytest.approx(res["ep1"]["losses"], rel=RTOL)
    initial = results[0]["initial"]
    moved = 0
    for res in results:
        got, want = res["ep2"]["weights"], res["ep1"]["weights"]
        assert got.keys() == want.keys() == initial.keys()
        for key, w in want.items():
            moved += not torch.equal(w, initial[key])
            torch.testing.assert_close(got[key], w, rtol=RTOL, atol=RTOL * w.abs().max().item(), msg=lambda m, k=key: f"{k}: {m}")
    assert moved > len(initial)  # on both ranks most tensors changed, experts and routers included


def test_ep2_dist_checkpoint_resumes_at_ep1_exactly(results):
    for res in results:
        saved, loaded = res["ep2"]["weights"], res["loaded_at_ep1"]
        assert loaded.keys() == saved.keys()
        for key, want in saved.items():
            assert torch.equal(loaded[key], want), key

