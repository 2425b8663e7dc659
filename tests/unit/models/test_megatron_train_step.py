"""One training step (forward, backward, Megatron DDP + distributed optimizer + grad clipping) at TP=2, at PP=2
and at CP=2 gives the same updated weights as TP=1 (DP=2), within 1e-5 relative, compared as full HF-named tensors.

One spawn of 2 gloo ranks runs the three layouts in turn on the same tiny Qwen2 checkpoint (tied
embeddings: at PP=2 the embedding gradient crosses stages) and the same global batch of 4 sequences:
DP=2 takes 2 micro-batches of 1 per rank, DP=1 takes 4. Megatron divides each micro-batch loss by the
number of micro-batches and DDP averages over DP ranks, so all layouts minimise the same mean loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack
from tests.unit.models._hf_fixtures import make_tiny_hf
from tests.unit.models._megatron_step import build_trainable, export, train_step

LAYOUTS = {
    "tp1": ParallelConfig(),
    "tp2": ParallelConfig(tensor_model_parallel_size=2),
    "pp2": ParallelConfig(pipeline_model_parallel_size=2),
    "cp2": ParallelConfig(context_parallel_size=2),  # local spec + megatron_patches' CP attention
}
RTOL = 1e-5


def _one_step(par: ParallelConfig, path: str) -> dict[str, Any]:
    from mcore_agentic.parallel.layout import destroy_parallel

    trainable = build_trainable(par, path)
    out = train_step(trainable)
    out["weights"] = export(trainable)
    destroy_parallel()
    return out


def _body(rank: int, world_size: int, path: str) -> bytes:
    import megatron_patches
    from tests.helpers.hf import load_hf_state_dict

    megatron_patches.apply()
    out = {name: _one_step(par, path) for name, par in LAYOUTS.items()}
    out["initial"] = load_hf_state_dict(path)
    return pack(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    path = make_tiny_hf("Qwen2ForCausalLM", tmp_path_factory.mktemp("tiny") / "qwen2_tied", tied=True)
    return [unpack(r) for r in run_distributed(_body, 2, args=(str(path),))]


def test_step_taken_with_same_grad_norm(results):
    ref = results[0]["tp1"]["grad_norm"]
    assert ref > 1.0  # clipping (clip_grad=1.0) is active, so the norm's reduction is exercised too
    for res in results:
        for name in LAYOUTS:
            assert res[name]["ok"]
            assert res[name]["grad_norm"] == pytest.approx(ref, rel=RTOL), name


@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2"])
def test_updated_weights_match_tp1(results, layout):
    initial, ref = results[0]["initial"], results[0]["tp1"]["weights"]
    for res in results:
        got = res[layout]["weights"]
        assert got.keys() == ref.keys()
        for key, want in ref.items():
            assert not torch.equal(want, initial[key]), f"{key} did not change in the TP=1 step"
            torch.testing.assert_close(got[key], want, rtol=RTOL, atol=RTOL * want.abs().max().item(),
                                       msg=lambda m, k=key: f"{layout} {k}: {m}")
