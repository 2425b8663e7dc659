"""Qwen3-MoE through the bridge: Megatron logits equal HF transformers' and the export reproduces the
checkpoint bitwise, at EP=1 (DP=2), EP=2 (each rank holds 4 of the 8 experts), PP=2 and TP=2 (forward only:
Megatron trains MoE at TP > 1 only with sequence parallelism, a GPU path); 2 gloo ranks each.

The HF reference is transformers' own Qwen3-MoE (softmax over the experts, top-2, renormalised), every
weight re-drawn at a visible scale; the checkpoint on disk holds per-expert tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import VOCAB, eval_chunks, hf_logits, make_tiny_hf, pack, unpack
from tests.unit.models.test_megatron_vs_hf_logits import _forward_logits

ARCH = "Qwen3MoeForCausalLM"
TOL = 1e-4


def _layout(par: ParallelConfig, path: str, input_ids: torch.Tensor) -> dict:
    from safetensors.torch import load_file

    from mcore_agentic.parallel.layout import initialize_parallel

    initialize_parallel(par, seed=1234)
    bridge, chunks = eval_chunks(path, par)
    experts = sorted(name for name in bridge.local_params(chunks) if bridge.is_expert(name))
    logits = _forward_logits(chunks, input_ids, par)
    exported = dict(bridge.export_hf_weights(chunks))
    on_disk = load_file(str(Path(path) / "model.safetensors"))
    same = sorted(exported) == sorted(on_disk) and all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    return {"logits": None if logits is None else logits[..., :VOCAB], "experts": experts, "export_equal": same,
            "exported": len(exported)}


def _body(rank: int, world_size: int, path: str, input_ids: torch.Tensor) -> bytes:
    """Every layout in turn (parallel state torn down between them)."""
    import megatron_patches
    from mcore_agentic.parallel.layout import destroy_parallel

    megatron_patches.apply()
    out = {}
    for name, par in LAYOUTS.items():
        out[name] = _layout(par, path, input_ids)
        destroy_parallel()
    return pack(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.Tensor, dict[str, list[dict]]]:
    """The HF logits, and per layout each rank's results (one spawn of 2 ranks runs every layout)."""
    path = make_tiny_hf(ARCH, tmp_path_factory.mktemp("moe") / ARCH)
    input_ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
    per_rank = [unpack(r) for r in run_distributed(_body, world_size=2, args=(str(path), input_ids))]
    return hf_logits(path, input_ids), {name: [r[name] for r in per_rank] for name in LAYOUTS}


LAYOUTS = {
    "ep1_dp2": ParallelConfig(),
    "ep2": ParallelConfig(expert_model_parallel_size=2),
    "pp2": ParallelConfig(pipeline_model_parallel_size=2),
    "tp2": ParallelConfig(tensor_model_parallel_size=2),  # forward only: MoE training at TP > 1 needs SP (GPU)
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_logits_match_hf_and_export_is_the_checkpoint(layout: str, checkpoint) -> None:
    expected, runs = checkpoint
    results = runs[layout]
    for rank, res in enumerate(results):
        assert res["export_equal"], f"{layout} rank {rank}: the export differs from the checkpoint"
        # embedding, per layer (q k v o, q/k norms, 2 layer norms, router, 8 x 3 expert matrices), final norm, lm_head
        assert res["exported"] == 1 + 2 * (8 + 1 + 8 * 3) + 1 + 1
        if res["logits"] is not None:
            diff = (res["logits"] - expected).abs().max().item()
            assert diff <= TOL, f"{layout} rank {rank}: max |megatron - hf| = {diff:.2e}"
            assert expected.abs().max().item() > 100 * TOL
    if layout == "ep2":  # each rank holds its own half of every layer's experts, by global index
        held = [{int(n.split(".")[6]) for n in res["experts"]} for res in results]
        assert held == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    if layout == "pp2":
        assert results[0]["logits"] is None and results[1]["logits"] is not None
