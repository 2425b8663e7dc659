"""Synthetic rollout rows for worker and sharding tests: left-padded prompts ++ right-padded responses."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PaddedRows:
    prompts: torch.Tensor  # [n, prompt_width], left-padded with 0
    responses: torch.Tensor  # [n, response_width], right-padded with 0
    attention_mask: torch.Tensor  # [n, prompt_width + response_width]
    loss_mask: torch.Tensor  # [n, response_width]: the responses' tokens less a "tool result" hole on every other row


def padded_rows(
    g: torch.Generator, n: int, *, prompt_width: int, response_width: int, vocab: int, min_response: int,
    hole: slice, response_lengths: list[int] | None = None,
) -> PaddedRows:
    """``n`` rows of random ids in ``[1, vocab)``: each a prompt of 1..``prompt_width`` tokens and a response of
    ``response_lengths[i]`` tokens (default: ``min_response``..``response_width``, drawn after the prompt's length);
    the loss mask drops the response positions ``hole`` of the even rows (attended to, not trained on)."""
    prompts = torch.zeros(n, prompt_width, dtype=torch.long)
    responses = torch.zeros(n, response_width, dtype=torch.long)
    pmask = torch.zeros(n, prompt_width, dtype=torch.long)
    rmask = torch.zeros(n, response_width, dtype=torch.long)
    for i in range(n):
        p = int(torch.randint(1, prompt_width + 1, (1,), generator=g))
        if response_lengths:
            r = response_lengths[i]
        else:
            r = int(torch.randint(min_response, response_width + 1, (1,), generator=g))
        prompts[i, prompt_width - p :] = torch.randint(1, vocab, (p,), generator=g)
        pmask[i, prompt_width - p :] = 1
        responses[i, :r] = torch.randint(1, vocab, (r,), generator=g)
        rmask[i, :r] = 1
    loss_mask = rmask.clone()
    loss_mask[::2, hole] = 0
    return PaddedRows(prompts, responses, torch.cat([pmask, rmask], 1), loss_mask)


def hand_off_tensors(b: int = 2, p: int = 3, r: int = 4) -> dict[str, torch.Tensor]:
    """The tensors every run hands a replica (layout and the always-sent fields), zeros, for ``b`` rows of ``p``
    prompt and ``r`` response positions."""
    t = {k: torch.zeros(b, p + r, dtype=torch.long) for k in ("input_ids", "attention_mask", "position_ids")}
    t.update(prompts=torch.zeros(b, p, dtype=torch.long), responses=torch.zeros(b, r, dtype=torch.long),
             response_mask=torch.ones(b, r, dtype=torch.long), rollout_log_probs=torch.zeros(b, r),
             seq_scores=torch.zeros(b), group_index=torch.arange(b), truncated=torch.zeros(b, dtype=torch.long),
             weight_version=torch.zeros(b, dtype=torch.long))
    return t
