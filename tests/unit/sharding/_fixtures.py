"""Tiny Qwen2 checkpoints (tied or not), a multi-turn-shaped batch and teacher-forced log-probs for sharding tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcore_agentic.data.batch import Batch
from tests.helpers.batches import padded_rows
from tests.helpers.hf import redraw_weights, tiny_qwen2_config

VOCAB = 300  # not a multiple of 128: Megatron pads the vocabulary, which the export must remove
PROMPT, RESPONSE = 5, 8


def hf_config(*, tied: bool = False, layers: int = 2) -> Any:
    return tiny_qwen2_config(vocab=VOCAB, layers=layers, max_positions=64, tied=tied)


def random_model(config: Any, seed: int) -> torch.nn.Module:
    """A Qwen2 model with weights large enough that log-probs carry signal (std-0.02 init is near uniform)."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = redraw_weights(transformers.Qwen2ForCausalLM(config).eval(), 0.1)
    return model


def save_checkpoint(path: Path, *, tied: bool = False, seed: int = 0, layers: int = 2) -> str:
    random_model(hf_config(tied=tied, layers=layers), seed).save_pretrained(str(path), safe_serialization=True)
    return str(path)


def make_batch(n: int = 8, *, seed: int = 0) -> Batch:
    """Left-padded prompts ++ right-padded responses, a tool-result hole in the loss mask, random advantages."""
    g = torch.Generator().manual_seed(seed)
    rows = padded_rows(g, n, prompt_width=PROMPT, response_width=RESPONSE, vocab=VOCAB, min_response=3, hole=slice(1, 2))
    return Batch(
        tensors={
            "prompts": rows.prompts,
            "responses": rows.responses,
            "input_ids": torch.cat([rows.prompts, rows.responses], 1),
            "attention_mask": rows.attention_mask,
            "response_mask": rows.loss_mask,
            "advantages": torch.randn(n, RESPONSE, generator=g) * rows.loss_mask,
        }
    )


@torch.no_grad()
def teacher_forced_log_probs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """``[B, R]`` log-probs of the response ids under an HF model (0 on response padding)."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, PROMPT - 1 : -1].float() / temperature, -1)
    out = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return out * mask[:, PROMPT:]
