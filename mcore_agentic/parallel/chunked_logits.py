"""Logits that never exist whole: per-token quantities of ``hidden @ W^T`` computed a chunk of tokens at a time.

A long agent row makes the last stage's logits the largest tensor of a step: ``[tokens, V / TP]`` in fp32 (the
model's output cast at the chunk boundary), kept for the backward pass, and its gradient of the same size. Here the
model stops before its output layer (:func:`mcore_agentic.models.deferred_logits.defer_output_layer`: the layer's
input preparation runs — the sequence-parallel gather, or the copy into the tensor-parallel region whose backward
all-reduces — but not its matmul) and hands its hidden states on; :class:`HiddenStates` then computes whatever the
head wants (log-probs, entropy, a teacher's top k) from the logits of ``chunk_tokens`` tokens at a time. Under
autograd each chunk is a non-reentrant checkpoint: its logits are dropped after the forward pass and made again,
one chunk at a time, in the backward pass (one more ``[chunk, h] x [h, V / TP]`` matmul per chunk), so at most one
chunk's logits and work buffers exist at once in either pass. The values are the unchunked ones bit for bit: the
same matmul in the same dtype per token (rows of a matmul do not depend on the other rows), then the same
vocabulary-parallel functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

ChunkFn = Callable[[torch.Tensor, slice], dict[str, torch.Tensor]]
"""``fn(logits [b, s_chunk, V_local], positions)``: per-token outputs ``[b, s_chunk, ...]`` of those positions."""


@dataclass
class HiddenStates:
    """The last stage's output with deferred logits: ``hidden`` ``[b, s, h]`` (float32, as the model's output is) and
    this rank's output-layer weight ``[V_local, h]`` (the tied embedding's when they share)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    chunk_tokens: int

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def logits(self, positions: slice) -> torch.Tensor:
        """The logits of token ``positions``, in float32, as the output layer and the model's cast would give them."""
        h = self.hidden[:, positions]
        return torch.matmul(h.to(self.weight.dtype), self.weight.t()).float()

    def per_token(self, fn: ChunkFn) -> dict[str, torch.Tensor]:
        """``fn`` over the logits of every chunk of tokens, its outputs concatenated along the sequence."""
        seq = self.hidden.shape[1]
        step = max(int(self.chunk_tokens), 1)
        track = torch.is_grad_enabled() and (self.hidden.requires_grad or self.weight.requires_grad)
        parts: list[dict[str, torch.Tensor]] = []
        for start in range(0, seq, step):
            positions = slice(start, min(start + step, seq))
            if track:
                parts.append(checkpoint(_chunk, self, positions, fn, use_reentrant=False, preserve_rng_state=False))
            else:
                parts.append(_chunk(self, positions, fn))
        if len(parts) == 1:
            return parts[0]
        return {key: torch.cat([p[key] for p in parts], dim=1) for key in parts[0]}


def _chunk(states: HiddenStates, positions: slice, fn: ChunkFn) -> dict[str, torch.Tensor]:
    return fn(states.logits(positions), positions)


__all__ = ["ChunkFn", "HiddenStates"]
