"""Sequence preparation for Megatron forwards: strip left padding, pad for CP, map outputs to responses.

Megatron's GPTModel applies RoPE by absolute position within the row (it does
not read ``position_ids``), and its local attention is causal with no padding
mask. Both are right for a row exactly when its real tokens start at position 0
and padding only follows them: causal attention never lets a real token see a
later pad. So each row of ``input_ids`` (left-padded prompt ++ right-padded
response) is rolled left by its count of leading pads, and the rows are cut to
the longest real length, padded up to what the CP layout (and sequence
parallelism) can split.

Per-token model outputs ``out[i, t]`` (about the token after position t: its
log-prob, or the value of the state before it) are mapped back to the ``[B, R]``
response layout: response token j of row i sits at ``P + j`` in ``input_ids``,
at ``P + j - left_pad[i]`` after the roll, and is predicted from the position
before it.

Rows are then split into micro-batches: fixed size, or by a padded-token budget. A
micro-batch is a list of row indices; outputs are scattered back by those indices, which
is the (deterministic) inverse permutation. The token budget counts *padded* tokens,
``rows x longest row``, because micro-batches are run as dense ``[b, S]`` tensors: that is
what bounds activation memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore_agentic.config.errors import ConfigError
from mcore_agentic.parallel.cp_split import pad_to_multiple


@dataclass(frozen=True)
class PackedSequences:
    """Rows of one micro-batch with left padding removed (every row starts at position 0).

    ``tokens``/``labels``/``loss_pos_mask`` are ``[b, S]`` with ``S`` a multiple of the CP
    split; ``labels[i, t]`` is the token at ``t + 1`` (0 past the end).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    left_pad: torch.Tensor  # [b] long, leading pads removed from each row
    lengths: torch.Tensor  # [b] long, real tokens per row
    prompt_len: int  # P, the prompt width of the original layout
    response_len: int  # R

    @property
    def padded_len(self) -> int:
        return self.tokens.shape[1]

    def response_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [b, R], valid [b, R])``: where response token j's output sits in the packed row.

        ``valid`` is False on response positions that are padding (past the row's end).
        """
        j = torch.arange(self.response_len, device=self.tokens.device)
        # Output at packed position t predicts token t+1, so token P+j-left is predicted at P+j-1-left.
        idx = self.prompt_len + j.unsqueeze(0) - 1 - self.left_pad.unsqueeze(1)
        valid = (idx + 1) < self.lengths.unsqueeze(1)
        valid = valid & (idx >= 0)
        return idx.clamp(0, self.padded_len - 1), valid

    def to_response(self, per_token: torch.Tensor) -> torch.Tensor:
        """Map ``[b, S]`` per-token outputs to ``[b, R]`` response layout (0 on padding). Differentiable."""
        if per_token.shape[:2] != self.tokens.shape:
            raise ValueError(f"per-token output {tuple(per_token.shape)} does not match packed {tuple(self.tokens.shape)}")
        idx, valid = self.response_index()
        out = torch.gather(per_token, 1, idx)
        return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _check_contiguous(attention_mask: torch.Tensor) -> None:
    am = attention_mask.long()
    starts = (am[:, 1:] - am[:, :-1] == 1).sum(1) + (am[:, 0] == 1).long()
    if bool((starts > 1).any()):
        bad = int(torch.nonzero(starts > 1)[0, 0])
        raise ValueError(
            f"attention_mask row {bad} has a hole: real tokens must be one contiguous block "
            "(left-padded prompt ++ right-padded response); mask tool outputs with response_mask, not attention_mask"
        )


def pack_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    cp_size: int = 1,
    multiple_of: int = 1,
    pad_token_id: int = 0,
    min_len: int = 0,
) -> PackedSequences:
    """Roll each row so its real tokens start at 0; cut/pad to a length the CP layout can split.

    ``input_ids``/``attention_mask`` are ``[b, P + R]``; ``prompt_len`` is P.
    ``multiple_of`` is an extra length multiple (the TP size with sequence parallelism);
    ``min_len`` pads to at least that length (equal shapes across micro-batches).
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be equal [B, P+R]"
        )
    total = input_ids.shape[1]
    if not 0 < prompt_len <= total:
        raise ValueError(f"prompt_len={prompt_len} must be in (0, {total}]")
    _check_contiguous(attention_mask)
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    # Leading pads = index of the first real token (rows with no real token: 0).
    first = torch.where(mask.any(1), mask.long().argmax(1), torch.zeros_like(lengths))
    max_len = int(lengths.max()) if lengths.numel() else 0
    padded = pad_to_multiple(max(max_len, min_len, 1), cp_size, multiple_of)
    cols = torch.arange(padded, device=input_ids.device).unsqueeze(0)
    src = (first.unsqueeze(1) + cols).clamp(max=total - 1)
    real = cols < lengths.unsqueeze(1)
    tokens = torch.where(real, torch.gather(input_ids, 1, src), torch.full_like(src, pad_token_id))
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels = torch.where(cols + 1 < lengths.unsqueeze(1), labels, torch.zeros_like(labels))
    return PackedSequences(
        tokens=tokens,
        labels=labels,
        left_pad=first,
        lengths=lengths,
        prompt_len=prompt_len,
        response_len=total - prompt_len,
    )


def fixed_micro_batches(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter)."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be > 0")
    return [list(range(i, min(i + micro_batch_size, num_rows))) for i in range(0, num_rows, micro_batch_size)]


def token_budget_micro_batches(
    lengths: Sequence[int] | torch.Tensor,
    max_tokens: int,
    *,
    cp_size: int = 1,
    multiple_of: int = 1,
    field: str = "actor.ppo_max_token_len_per_gpu",
) -> list[list[int]]:
    """Group rows so each group's ``len(group) * padded(max length) <= max_tokens``.

    Rows are taken longest first (ties by index, so the split is deterministic) and
    added to the open group while the padded cost fits; similar lengths end up
    together, which keeps padding small. A row that alone exceeds the budget is a
    configuration error naming ``field``.
    """
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    current_len = 0
    for i in order:
        padded = pad_to_multiple(max(lens[i], 1), cp_size, multiple_of)
        if padded > max_tokens:
            raise ConfigError(
                field, f"{max_tokens} is smaller than one sequence ({padded} padded tokens): raise it to >= {padded}"
            )
        # Rows arrive longest first, so the group's padded length is fixed by its first row.
        if current and (len(current) + 1) * current_len > max_tokens:
            groups.append(current)
            current = []
        if not current:
            current_len = padded
        current.append(i)
    if current:
        groups.append(current)
    # Keep each group's rows in their original order (stable outputs, easier debugging).
    return [sorted(g) for g in groups]


def scatter_rows(pieces: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], num_rows: int) -> torch.Tensor:
    """Inverse of splitting rows into ``groups``: ``out[groups[k][r]] = pieces[k][r]``."""
    if len(pieces) != len(groups):
        raise ValueError(f"{len(pieces)} outputs for {len(groups)} micro-batches")
    first = pieces[0]
    out = first.new_zeros((num_rows, *first.shape[1:]))
    for piece, rows in zip(pieces, groups):
        out[torch.as_tensor(list(rows), dtype=torch.long, device=out.device)] = piece
    return out


__all__ = ["PackedSequences", "fixed_micro_batches", "pack_sequences", "scatter_rows", "token_budget_micro_batches"]
