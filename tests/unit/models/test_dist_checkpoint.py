"""A Megatron distributed checkpoint (torch_dist) of a trained model saved at TP=2 and loaded at TP=1 (DP=2)
reproduces the weights exactly (full HF-named tensors exported by the bridge).

Model weights only: resharding the distributed optimizer's state (``fully_reshardable``) with torch's Adam
needs the workarounds in ``mcore_agentic.trainer.model_checkpoint`` and is tested there.
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


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights no file holds (same on every rank): the checkpoint, not the HF import, must supply them."""
    gen = torch.Generator().manual_seed(3)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def _body(rank: int, world_size: int, path: str, ckpt_dir: str) -> bytes:
    from megatron.core import dist_checkpointing

    import megatron_patches
    from mcore_agentic.parallel.layout import destroy_parallel
    from tests.helpers.hf import load_hf_state_dict

    megatron_patches.apply()
    original = load_hf_state_dict(path)
    target = _perturbed(original)
    out: dict[str, Any] = {"target": target}

    t = build_trainable(ParallelConfig(tensor_model_parallel_size=2), path, target)
    out["imported"] = export(t)
    train_step(t)  # save trained weights, not imported ones
    out["saved"] = export(t)
    dist_checkpointing.save(t.chunks[0].sharded_state_dict(), ckpt_dir)
    destroy_parallel()

    t = build_trainable(ParallelConfig(), path, original)  # TP=1, DP=2, starting from other weights
    out["before"] = export(t)
    t.chunks[0].load_state_dict(dist_checkpointing.load(t.chunks[0].sharded_state_dict(), ckpt_dir))
    out["loaded"] = export(t)
    destroy_parallel()
    return pack(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("dist_ckpt")
    path = make_tiny_hf("Qwen2ForCausalLM", root / "qwen2", tied=False)
    (root / "ckpt").mkdir()
    return [unpack(r) for r in run_distributed(_body, 2, args=(str(path), str(root / "ckpt")))]


def test_import_is_exact(results):
    for res in results:
        for key, want in res["target"].items():
            assert torch.equal(res["imported"][key], want), key


def test_tp2_checkpoint_loads_at_tp1_exactly(results):
    for res in results:
        assert res["loaded"].keys() == res["saved"].keys()
        for key, want in res["saved"].items():
            assert not torch.equal(res["before"][key], want), f"{key}: TP=1 model already held the weights"
            assert torch.equal(res["loaded"][key], want), key
