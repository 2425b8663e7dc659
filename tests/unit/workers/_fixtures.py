"""Tiny HF checkpoint, a synthetic multi-turn-shaped batch and the per-rank worker setup for worker tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcore_agentic.algorithms.turn_advantages import compute_grpo_turn_advantage
from mcore_agentic.data.batch import Batch
from tests.helpers.batches import padded_rows
from tests.helpers.hf import redraw_weights, tiny_qwen2_config

VOCAB = 500  # not a multiple of 128: Megatron pads the vocabulary, which log-probs must exclude
PROMPT, RESPONSE = 6, 10


def make_tiny_hf(path: Path, *, seed: int = 0, layers: int = 2, max_positions: int = 128) -> Path:
    """A random ``layers``-layer Qwen2 (hidden 64, GQA 4/2) saved as safetensors; weights scaled to carry signal."""
    import transformers

    config = tiny_qwen2_config(vocab=VOCAB, layers=layers, max_positions=max_positions)
    torch.manual_seed(seed)
    model = redraw_weights(transformers.Qwen2ForCausalLM(config).eval(), 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def make_tiny_teacher(path: Path, *, seed: int = 5, max_positions: int = 128) -> Path:
    """A distillation teacher of another shape than :func:`make_tiny_hf`'s student: 8 layers, hidden 96, ffn 160,
    6 attention heads over 2 KV heads; the same vocabulary."""
    import transformers

    config = tiny_qwen2_config(vocab=VOCAB, layers=8, max_positions=max_positions)
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 96, 160, 6
    torch.manual_seed(seed)
    model = redraw_weights(transformers.Qwen2ForCausalLM(config).eval(), 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def make_batch(n: int = 8, *, seed: int = 0, response_lengths: list[int] | None = None) -> Batch:
    """Left-padded prompts ++ right-padded responses with a tool-result hole in the loss mask.

    ``response_lengths`` fixes each row's response length (the response width is the longest);
    by default they are random in ``[2, RESPONSE]``."""
    g = torch.Generator().manual_seed(seed)
    width = max(response_lengths) if response_lengths else RESPONSE
    rows = padded_rows(g, n, prompt_width=PROMPT, response_width=width, vocab=VOCAB, min_response=2,
                       hole=slice(1, 3), response_lengths=response_lengths)
    loss_mask, attention_mask = rows.loss_mask, rows.attention_mask
    # Advantages with turn structure (the tool-result hole splits the even rows into two turns): grpo_turn's over
    # random per-token rewards (O(1) per row), groups of two rows, plus per-token noise so a misaligned token still
    # shows. Every layout of test_workers_parallel then trains turn-level credit against the TP=1 reference.
    token_rewards = torch.randn(n, width, generator=g) * loss_mask / loss_mask.sum(1, keepdim=True).clamp(min=1).sqrt()
    turn_level, _ = compute_grpo_turn_advantage(token_rewards, loss_mask, [str(i // 2) for i in range(n)])
    return Batch(
        tensors={
            "prompts": rows.prompts,
            "responses": rows.responses,
            "input_ids": torch.cat([rows.prompts, rows.responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": loss_mask,
            "advantages": (turn_level + 0.5 * torch.randn(n, width, generator=g)) * loss_mask,
            "returns": torch.randn(n, width, generator=g) * loss_mask,
        }
    )


def _hf_response_log_softmax(path: str, batch: Batch, temperature: float) -> torch.Tensor:
    """``[B, R, V]`` next-token log-probs at the response positions under the HF model (attention mask + position ids)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    return torch.log_softmax(logits[:, PROMPT - 1 : -1].float() / temperature, -1)


def hf_response_log_probs(path: str, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``[B, R]`` of the response tokens under the HF model (attention mask + position ids)."""
    out = _hf_response_log_softmax(path, batch, temperature).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return out * batch["attention_mask"][:, PROMPT:]


def hf_response_top_k(path: str, batch: Batch, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model's ``k`` most likely next tokens at each response position: ``(log_probs, ids)`` ``[B, R, k]``,
    0 on response padding."""
    top = _hf_response_log_softmax(path, batch, temperature).topk(k, dim=-1)
    real = batch["attention_mask"][:, PROMPT:].unsqueeze(-1)
    return top.values * real, top.indices * real


def setup_rank(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1, vpp: int | None = None) -> Any:
    """Apply the CPU patches and initialise Megatron's parallel state; returns the layout."""
    import megatron_patches
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel

    megatron_patches.apply()
    cfg = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    return cfg, initialize_parallel(cfg, seed)


def global_rows(per_rank: list[dict], key: str, num_rows: int) -> torch.Tensor:
    """A per-replica output (``per_rank[r][key]`` for rows ``per_rank[r]["rows"]``) put back in global row order."""
    first = per_rank[0][key]
    out = first.new_zeros((num_rows, *first.shape[1:]))
    for r in per_rank:
        out[torch.tensor(r["rows"])] = r[key]
    return out
