"""The transformers engine's per-request sampling (:mod:`~mcore_agentic.rollout.engines.hf`): one token from a row
of logits under a request's own generator, and the advance of that generator past a cut generation's draws."""

from __future__ import annotations

import torch

from mcore_agentic.rollout.engines.base import SamplingParams


def advance_draws(gen: torch.Generator, count: int, width: int) -> None:
    """Advance ``gen`` past ``count`` sampled tokens of :func:`sample_token` over ``width`` logits: each is one
    ``torch.multinomial(probs, 1)``, which draws ``exponential_`` over a float32 row as wide as ``probs``."""
    row = torch.empty(width, dtype=torch.float32)
    for _ in range(count):
        row.exponential_(generator=gen)


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """Sample one id from 1-D ``logits``; return it and its logprob under ``softmax(logits / T)``.

    Top-k then top-p filter the sampling distribution only; the logprob is taken before them
    (the documented convention of :mod:`mcore_agentic.rollout.engines.base`).
    """
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if params.temperature == 0:
        token = int(torch.argmax(scaled))
        return token, float(logprobs[token])
    filtered = scaled.clone()
    if params.top_k > 0 and params.top_k < filtered.numel():
        kth = torch.topk(filtered, params.top_k).values[-1]
        filtered[filtered < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        filtered[order[drop]] = float("-inf")
    probs = torch.softmax(filtered, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logprobs[token])


__all__ = ["advance_draws", "sample_token"]
