"""Sequence preparation for Megatron forwards: rows of a micro-batch packed (THD) or padded, and back.

A rank's rows arrive in the rollout layout (left-padded prompt ++ right-padded response).
Megatron wants every row's real tokens to start at position 0 (RoPE positions, causal
attention with no padding mask). Two layouts do that:

* **packed** (THD, the default, ``use_remove_padding``): the rows' real tokens, each padded
  only to what the CP split (and sequence parallelism) can cut, concatenated into one
  ``[1, T]`` sequence with ``cu_seqlens`` (Megatron's ``PackedSeqParams``). Attention is
  per row and RoPE restarts at each row, so a micro-batch costs its real tokens, not
  ``rows x longest``;
* **padded** (for debugging): ``[b, S]`` with every row rolled left by its leading pads and
  cut to the longest row.

Per-token model outputs ``out[t]`` (about the token after position t: its log-prob, or the
value of the state before it) map back to the ``[b, R]`` response layout through each row's
flat start: response token j of row i sits at ``P + j - left_pad[i]`` within the row and is
predicted from the position before it.

Micro-batches: fixed row counts, or a token budget (``use_dynamic_bsz``). Packed, the budget
counts real (CP-padded) tokens and rows are dealt over the fewest micro-batches that fit by a
balanced partition (:mod:`mcore_agentic.data.balance`); padded, it counts ``rows x longest``.
A micro-batch is a list of row indices; :func:`scatter_rows` is the inverse permutation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore_agentic.data.balance import partition
from mcore_agentic.parallel.cp_split import pad_to_multiple
from mcore_agentic.utils.errors import ConfigError


@dataclass(frozen=True)
class PackedSequences:
    """Rows of one micro-batch with left padding removed (every row starts at its position 0).

    ``tokens``/``labels``/``position_ids`` are ``[b, S]`` (padded) or ``[1, T]`` (packed, THD);
    ``labels`` at a position is the row's next token (0 past the row's end).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    left_pad: torch.Tensor  # [b] long, leading pads removed from each row
    lengths: torch.Tensor  # [b] long, real tokens per row
    starts: torch.Tensor  # [b] long, flat index (into tokens.reshape(-1)) of each row's first token
    prompt_len: int  # P, the prompt width of the original layout
    response_len: int  # R
    cu_seqlens: torch.Tensor | None = None
    """Packed only: ``[n + 1]`` int32 offsets of the CP-padded segments (the rows, then a trailing
    padding segment when the micro-batch was padded to a common length)."""
    cu_seqlens_real: torch.Tensor | None = None
    """Packed only: cumulative sums of the segments' real lengths, padding left out (TE's ``cu_seqlens_q``)."""

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def padded_len(self) -> int:
        """The sequence dimension the model sees (``S``, or the packed ``T``)."""
        return self.tokens.shape[1]

    @property
    def num_tokens(self) -> int:
        """Tokens the model runs (padding included)."""
        return self.tokens.numel()

    @property
    def max_seqlen(self) -> int:
        """Longest segment (packed) or the row width (padded)."""
        if self.cu_seqlens is None:
            return self.padded_len
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def gather_tokens(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """Per-token ``values`` of the original rows (``[b, P + R, ...]``, aligned with ``input_ids``) in this
        layout: ``[*tokens.shape, ...]``, ``fill`` on padding."""
        out = values.new_full((self.num_tokens, *values.shape[2:]), fill)
        for i, (first, n, start) in enumerate(zip(self.left_pad.tolist(), self.lengths.tolist(), self.starts.tolist())):
            out[start : start + n] = values[i, first : first + n]
        return out.view(*self.tokens.shape, *values.shape[2:])

    def response_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat index [b, R], valid [b, R])``: where response token j's output sits in ``out.reshape(-1)``.

        ``valid`` is False on response positions that are padding (past the row's end).
        """
        j = torch.arange(self.response_len, device=self.tokens.device)
        # Output at row position t predicts token t+1, so token P+j-left is predicted at P+j-1-left.
        local = self.prompt_len + j.unsqueeze(0) - 1 - self.left_pad.unsqueeze(1)
        valid = ((local + 1) < self.lengths.unsqueeze(1)) & (local >= 0)
        flat = self.starts.unsqueeze(1) + local
        return flat.clamp(0, self.num_tokens - 1), valid

    def to_response(self, per_token: torch.Tensor) -> torch.Tensor:
        """Map per-token outputs (shaped like ``tokens``) to the ``[b, R]`` response layout (0 on padding). Differentiable."""
        if per_token.shape[:2] != self.tokens.shape:
            raise ValueError(f"per-token output {tuple(per_token.shape)} does not match tokens {tuple(self.tokens.shape)}")
        idx, valid = self.response_index()
        out = per_token.reshape(-1, *per_token.shape[2:])[idx]  # [b, R, ...]
        valid = valid.reshape(*valid.shape, *([1] * (out.dim() - 2)))
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


def _real_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, lengths)``: each row's first real column and its count of real tokens."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be equal [B, P+R]"
        )
    if not 0 < prompt_len <= input_ids.shape[1]:
        raise ValueError(f"prompt_len={prompt_len} must be in (0, {input_ids.shape[1]}]")
    _check_contiguous(attention_mask)
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    first = torch.where(mask.any(1), mask.long().argmax(1), torch.zeros_like(lengths))  # rows with none: 0
    return first, lengths


def segment_lengths(
    attention_mask: torch.Tensor, *, cp_size: int = 1, multiple_of: int = 1
) -> list[int]:
    """Each row's packed segment: its real tokens padded to what the CP split can cut (at least one chunk)."""
    return [pad_to_multiple(max(int(n), 1), cp_size, multiple_of) for n in attention_mask.sum(1).tolist()]


def pad_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    cp_size: int = 1,
    multiple_of: int = 1,
    pad_token_id: int = 0,
    min_len: int = 0,
) -> PackedSequences:
    """The padded layout: roll each row so its real tokens start at 0; cut/pad to a length the CP layout can split.

    ``input_ids``/``attention_mask`` are ``[b, P + R]``; ``prompt_len`` is P.
    ``multiple_of`` is an extra length multiple (the TP size with sequence parallelism);
    ``min_len`` pads to at least that length (equal shapes across micro-batches).
    """
    first, lengths = _real_spans(input_ids, attention_mask, prompt_len)
    total = input_ids.shape[1]
    max_len = int(lengths.max()) if lengths.numel() else 0
    padded = pad_to_multiple(max(max_len, min_len, 1), cp_size, multiple_of)
    cols = torch.arange(padded, device=input_ids.device).unsqueeze(0)
    src = (first.unsqueeze(1) + cols).clamp(max=total - 1)
    real = cols < lengths.unsqueeze(1)
    tokens = torch.where(real, torch.gather(input_ids, 1, src), torch.full_like(src, pad_token_id))
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels = torch.where(cols + 1 < lengths.unsqueeze(1), labels, torch.zeros_like(labels))
    b = tokens.shape[0]
    return PackedSequences(
        tokens=tokens,
        labels=labels,
        position_ids=cols.expand(b, -1),
        left_pad=first,
        lengths=lengths,
        starts=torch.arange(b, device=tokens.device) * padded,
        prompt_len=prompt_len,
        response_len=total - prompt_len,
    )


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    cp_size: int = 1,
    multiple_of: int = 1,
    pad_token_id: int = 0,
    min_total: int = 0,
) -> PackedSequences:
    """The packed (THD) layout: one ``[1, T]`` sequence of the rows' real tokens with ``cu_seqlens``.

    Each row is padded at its end to a multiple the CP split can cut (``2 * cp_size``, and
    ``multiple_of``); padding only follows real tokens, so causal attention within the row keeps
    it out of every real token's context. ``min_total`` appends one padding segment to reach
    that total (equal shapes across micro-batches for the interleaved pipeline schedule).
    """
    first, lengths = _real_spans(input_ids, attention_mask, prompt_len)
    seg = segment_lengths(attention_mask, cp_size=cp_size, multiple_of=multiple_of)
    total = sum(seg)
    if min_total > total:
        extra = pad_to_multiple(min_total - total, cp_size, multiple_of)
        seg_all, real_all = seg + [extra], lengths.tolist() + [0]
    else:
        seg_all, real_all = seg, lengths.tolist()
    t = sum(seg_all)
    device = input_ids.device
    tokens = torch.full((t,), pad_token_id, dtype=input_ids.dtype, device=device)
    labels = torch.zeros((t,), dtype=input_ids.dtype, device=device)
    positions = torch.zeros((t,), dtype=torch.long, device=device)
    offset = 0
    starts = []
    for i, (s, n) in enumerate(zip(seg_all, real_all)):
        starts.append(offset)
        positions[offset : offset + s] = torch.arange(s, device=device)
        if i < len(seg) and n:
            row = input_ids[i, int(first[i]) : int(first[i]) + n]
            tokens[offset : offset + n] = row
            labels[offset : offset + n - 1] = row[1:]
        offset += s
    cu = torch.tensor([0, *torch.tensor(seg_all).cumsum(0).tolist()], dtype=torch.int32, device=device)
    # TE's convention: cu_seqlens sums the real lengths only; the padded offsets are cu_seqlens_padded.
    cu_real = torch.tensor([0, *torch.tensor(real_all).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return PackedSequences(
        tokens=tokens.unsqueeze(0),
        labels=labels.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        left_pad=first,
        lengths=lengths,
        starts=torch.tensor(starts[: len(seg)], dtype=torch.long, device=device),
        prompt_len=prompt_len,
        response_len=input_ids.shape[1] - prompt_len,
        cu_seqlens=cu,
        cu_seqlens_real=cu_real,
    )


# ----------------------------------------------------------------------------------- micro-batches
def fixed_micro_batches(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter)."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be > 0")
    return [list(range(i, min(i + micro_batch_size, num_rows))) for i in range(0, num_rows, micro_batch_size)]


def _too_long(field: str, max_tokens: int, need: int) -> ConfigError:
    return ConfigError(field, f"{max_tokens} is smaller than one sequence ({need} padded tokens): raise it to >= {need}")


def padded_budget_micro_batches(
    lengths: Sequence[int] | torch.Tensor,
    max_tokens: int,
    *,
    cp_size: int = 1,
    multiple_of: int = 1,
    field: str = "actor.ppo_max_token_len_per_gpu",
) -> list[list[int]]:
    """Padded layout: group rows so each group's ``len(group) * padded(max length) <= max_tokens``.

    Rows are taken longest first (ties by index, so the split is deterministic) and added to the
    open group while the padded cost fits; similar lengths end up together, which keeps padding
    small. A row that alone exceeds the budget is a configuration error naming ``field``.
    """
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    current_len = 0
    for i in order:
        padded = pad_to_multiple(max(lens[i], 1), cp_size, multiple_of)
        if padded > max_tokens:
            raise _too_long(field, max_tokens, padded)
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


def packed_budget_count(segments: Sequence[int], max_tokens: int, *, field: str = "actor.ppo_max_token_len_per_gpu") -> int:
    """Fewest micro-batches whose balanced partition keeps every packed micro-batch within ``max_tokens``."""
    if not segments:
        return 0
    if max(segments) > max_tokens:
        raise _too_long(field, max_tokens, max(segments))
    k = max(1, -(-sum(segments) // max_tokens))
    while max(sum(segments[i] for i in b) for b in partition(segments, k)) > max_tokens:
        k += 1  # ends: with one row per micro-batch every bin fits
    return k


def packed_budget_micro_batches(segments: Sequence[int], count: int) -> list[list[int]]:
    """Rows dealt over ``count`` micro-batches with balanced token sums (each micro-batch's rows in order)."""
    if count > len(segments):
        raise ValueError(f"{count} micro-batches for {len(segments)} rows: every micro-batch needs a row")
    bins = partition(segments, count)
    return sorted(bins, key=lambda b: b[0])


def scatter_rows(pieces: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], num_rows: int) -> torch.Tensor:
    """Inverse of splitting rows into ``groups``: ``out[groups[k][r]] = pieces[k][r]``."""
    if len(pieces) != len(groups):
        raise ValueError(f"{len(pieces)} outputs for {len(groups)} micro-batches")
    first = pieces[0]
    out = first.new_zeros((num_rows, *first.shape[1:]))
    for piece, rows in zip(pieces, groups):
        out[torch.as_tensor(list(rows), dtype=torch.long, device=out.device)] = piece
    return out


__all__ = [
    "PackedSequences",
    "fixed_micro_batches",
    "pack_rows",
    "packed_budget_count",
    "packed_budget_micro_batches",
    "pad_rows",
    "padded_budget_micro_batches",
    "scatter_rows",
    "segment_lengths",
]
