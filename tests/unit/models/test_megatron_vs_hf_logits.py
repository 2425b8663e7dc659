"""Megatron logits (bridge-built, HF weights loaded) equal HF transformers logits, per parallel layout.

Each layout is one spawn of 2 gloo ranks that checks every architecture in it:
TP=1 (DP=2), TP=2, PP=2 (through Megatron's forward-only pipeline schedule) and
CP=2 (load-balanced sequence split, logits gathered back).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import VOCAB, eval_chunks, hf_logits, make_tiny_hf, pack, unpack

TOL = 1e-4
BATCH, SEQ = 2, 8


def _forward_logits(chunks: list, input_ids: torch.Tensor, par: ParallelConfig) -> torch.Tensor | None:
    """Full-vocab logits [b, s, Vp] of this model on every rank of the last PP stage, else None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mcore_agentic.parallel.cp_split import cp_gather, cp_positions, cp_split

    cp, cp_rank = par.context_parallel_size, ps.get_context_parallel_rank()
    ids = cp_split(input_ids, cp, cp_rank, seq_dim=1)
    positions = cp_positions(input_ids.shape[1], cp, cp_rank).unsqueeze(0).expand(ids.shape[0], -1)

    def forward_step(data_iterator, model):
        del data_iterator
        output = model(ids, positions, attention_mask=None)

        def keep_logits(output_tensor, non_loss_data=False):
            assert non_loss_data
            return output_tensor

        return output, keep_logits

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=chunks,
            num_microbatches=1,
            seq_length=ids.shape[1],
            micro_batch_size=ids.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(outputs[0])  # [b, s/cp, Vp]
    if cp > 1:
        logits = cp_gather(logits, cp, ps.get_context_parallel_group(), seq_dim=1)
    assert dist.is_initialized()
    return logits


def _logits_body(rank: int, world_size: int, par: ParallelConfig, cases: list[tuple[str, str, torch.Tensor]]) -> dict:
    import megatron_patches
    from mcore_agentic.parallel.layout import initialize_parallel

    megatron_patches.apply()
    initialize_parallel(par, seed=1234)
    out = {}
    for arch, path, input_ids in cases:
        bridge, chunks = eval_chunks(path, par)
        logits = _forward_logits(chunks, input_ids, par)
        if logits is not None:
            assert logits.shape[-1] == bridge.padded_vocab_size(par.tensor_model_parallel_size)
            out[arch] = logits[..., :VOCAB]
    return pack(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor]]:
    """arch -> (checkpoint dir, input ids, HF logits); Qwen2 tied, Qwen3 and Llama untied, Llama with 1 KV head."""
    root = tmp_path_factory.mktemp("hf")
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    out = {}
    # Llama gets a single KV head: at TP=2 that is Megatron's num_query_groups < TP path (replicated KV).
    for arch, tied, kv_heads in (
        ("Qwen2ForCausalLM", True, 2), ("Qwen3ForCausalLM", False, 2), ("LlamaForCausalLM", False, 1)
    ):
        path = make_tiny_hf(arch, root / arch, tied=tied, kv_heads=kv_heads)
        out[arch] = (path, input_ids, hf_logits(path, input_ids))
    return out


LAYOUTS = {
    "tp1_dp2": (ParallelConfig(), ("Qwen2ForCausalLM", "Qwen3ForCausalLM")),
    "tp2": (ParallelConfig(tensor_model_parallel_size=2), ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")),
    "pp2": (ParallelConfig(pipeline_model_parallel_size=2), ("Qwen2ForCausalLM", "Qwen3ForCausalLM")),
    "cp2": (ParallelConfig(context_parallel_size=2), ("Qwen2ForCausalLM", "Qwen3ForCausalLM")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_logits_match_hf(layout: str, checkpoints) -> None:
    par, archs = LAYOUTS[layout]
    if par.context_parallel_size > 1:
        pytest.importorskip("mcore_agentic.parallel.local_attention")
    cases = [(arch, str(checkpoints[arch][0]), checkpoints[arch][1]) for arch in archs]
    results = [unpack(r) for r in run_distributed(_logits_body, world_size=2, args=(par, cases))]
    last_stage_ranks = [1] if par.pipeline_model_parallel_size == 2 else [0, 1]
    for rank in last_stage_ranks:
        for arch in archs:
            expected = checkpoints[arch][2]
            got = results[rank][arch]
            assert got.shape == expected.shape, (layout, arch, rank)
            diff = (got - expected).abs().max().item()
            assert diff <= TOL, f"{layout} {arch} rank {rank}: max |megatron - hf| = {diff:.2e}"
            # Guard against a vacuous match: the logits carry signal well above the tolerance.
            assert expected.abs().max().item() > 100 * TOL
