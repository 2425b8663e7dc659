"""A 32k-token agent row trains at CP=2 with activation recomputation, chunked logits and packing, and its numbers
are the single-process reference's: TP=1, CP=1, no recomputation, the whole logits.

Rows: one of up to 32,768 tokens (a prompt of up to 512 tokens, a 32,256-token response with a tool-result hole in
its loss mask, as an agent's) packed with two short ones. Each layout scores the old log-probs (with entropy), takes one PPO update
(one micro-batch per replica) and scores again; the log-probs before and after the update (so the update itself)
must agree within 1e-5 (fp32; CP changes the reduction order of attention). Attention runs fused (SDPA on CPU, as
on a GPU): eager attention would keep a 16k x 32k score matrix per head.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed

TOL = 1e-5
LONG, PROMPT = 32768, 512
SHORT = [40, 9]  # response tokens of the other rows


def _batch() -> Any:
    from mcore_agentic.data.batch import Batch
    from tests.helpers.batches import padded_rows
    from tests.unit.workers._fixtures import VOCAB

    g = torch.Generator().manual_seed(0)
    # a prompt of up to 512 tokens and a 32,256-token response with a tool result (positions 1000-1400) in its mask
    rows = padded_rows(g, 1 + len(SHORT), prompt_width=PROMPT, response_width=LONG - PROMPT, vocab=VOCAB,
                       min_response=2, hole=slice(1000, 1400), response_lengths=[LONG - PROMPT, *SHORT])
    mask = rows.loss_mask
    return Batch(tensors={
        "prompts": rows.prompts, "responses": rows.responses, "input_ids": torch.cat([rows.prompts, rows.responses], 1),
        "attention_mask": rows.attention_mask, "position_ids": (rows.attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask, "advantages": torch.randn(mask.shape, generator=g) * mask,
    })


def _train(rank: int, world_size: int, path: str, cp: int, long_row_settings: bool) -> dict[str, torch.Tensor]:
    import megatron_patches
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.parallel.local_attention import LocalDotProductAttention
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig, RecomputeConfig

    megatron_patches.apply()
    LocalDotProductAttention.fused_devices = ("cuda", "cpu")
    par = ParallelConfig(context_parallel_size=cp)
    layout = initialize_parallel(par, 1)
    batch = _batch()
    n = len(batch)
    recompute = RecomputeConfig(recompute_granularity="full") if long_row_settings else RecomputeConfig()
    actor = Actor(ActorConfig(parallel=par, ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=n, shuffle=False,
                              optim=OptimConfig(lr=1e-3, eps=1e-2), recompute=recompute),
                  ModelSpec(path, "float32", parallel=par, logits_chunk_mb=1 if long_row_settings else 0),
                  layout, mini_batch_sequences=n)
    assert (actor.model.tcfg.recompute_granularity == "full") == long_row_settings
    assert (actor.model.logits_chunk_tokens > 0) == long_row_settings  # 1 MiB: 512 tokens a chunk
    before = actor.compute_log_prob(batch, calculate_entropy=True)
    metrics = actor.update_policy(before)
    after = actor.compute_log_prob(batch)
    destroy_parallel()
    return {"before": before["old_log_probs"], "entropys": before["entropys"], "after": after["old_log_probs"],
            "grad_norm": torch.tensor(metrics["grad_norm"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, torch.Tensor]]]:
    from tests.unit.workers._fixtures import make_tiny_hf

    path = str(make_tiny_hf(tmp_path_factory.mktemp("long") / "tiny", layers=1, max_positions=LONG + 64))
    return {"reference": run_distributed(_train, 1, args=(path, 1, False)),
            "cp2": run_distributed(_train, 2, args=(path, 2, True))}


def test_a_32k_token_row_at_cp2_with_recomputation_and_chunked_logits_equals_the_reference(runs):
    ref = runs["reference"][0]
    mask = _batch()["response_mask"].bool()
    assert mask[0].sum() > 30000
    for rank, got in enumerate(runs["cp2"]):  # every rank of the CP group returns its replica's rows
        for key in ("before", "entropys", "after"):
            torch.testing.assert_close(got[key][mask], ref[key][mask], rtol=TOL, atol=TOL, msg=f"rank {rank} {key}")
        assert not torch.equal(ref["after"][mask], ref["before"][mask])  # the update moved the policy
        assert float(got["grad_norm"]) == pytest.approx(float(ref["grad_norm"]), rel=TOL)
