"""A Megatron distributed checkpoint (torch_dist) saved at TP=2 and loaded at TP=1 (DP=2) reproduces the weights
exactly, compared as full HF-named tensors exported by the bridge."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack
from tests.unit.models._hf_fixtures import make_tiny_hf


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights no file holds (same on every rank): the checkpoint, not the HF import, must supply them."""
    gen = torch.Generator().manual_seed(3)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def _model(par: ParallelConfig, path: str, hf_state: dict[str, torch.Tensor]) -> tuple[Any, list[Any]]:
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.layout import initialize_parallel

    initialize_parallel(par, seed=1234)
    hf_config = load_hf_config(path)
    bridge = get_bridge(hf_config)
    chunks = bridge.build_model(hf_config, bridge.transformer_config(hf_config, par))
    bridge.load_hf_weights(chunks, hf_state)
    return bridge, chunks


def _body(rank: int, world_size: int, path: str, ckpt_dir: str) -> bytes:
    from megatron.core import dist_checkpointing

    import megatron_patches
    from mcore_agentic.models.hf_io import load_hf_state_dict
    from mcore_agentic.parallel.layout import destroy_parallel

    megatron_patches.apply()
    original = load_hf_state_dict(path)
    target = _perturbed(original)

    bridge, chunks = _model(ParallelConfig(tensor_model_parallel_size=2), path, target)
    saved = dict(bridge.export_hf_weights(chunks))
    dist_checkpointing.save(chunks[0].sharded_state_dict(), ckpt_dir)
    destroy_parallel()

    bridge, chunks = _model(ParallelConfig(), path, original)  # TP=1, DP=2, starting from other weights
    before = dict(bridge.export_hf_weights(chunks))
    state = dist_checkpointing.load(chunks[0].sharded_state_dict(), ckpt_dir)
    chunks[0].load_state_dict(state)
    loaded = dict(bridge.export_hf_weights(chunks))
    destroy_parallel()
    return pack({"target": target, "saved": saved, "before": before, "loaded": loaded})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("dist_ckpt")
    path = make_tiny_hf("Qwen2ForCausalLM", root / "qwen2", tied=False)
    (root / "ckpt").mkdir()
    return [unpack(r) for r in run_distributed(_body, 2, args=(str(path), str(root / "ckpt")))]


def test_saved_model_is_the_perturbed_one(results):
    for res in results:
        for key, want in res["target"].items():
            assert torch.equal(res["saved"][key], want), key


def test_tp2_checkpoint_loads_at_tp1_exactly(results):
    for res in results:
        assert res["loaded"].keys() == res["target"].keys()
        for key, want in res["target"].items():
            assert not torch.equal(res["before"][key], want), f"{key}: TP=1 model already held the weights"
            assert torch.equal(res["loaded"][key], want), key
