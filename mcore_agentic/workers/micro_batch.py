"""Splitting a rank's rows into micro-batches: fixed size, or by a padded-token budget.

A micro-batch is a list of row indices; outputs are scattered back by those
indices, which is the (deterministic) inverse permutation. The token budget
counts *padded* tokens, ``rows x longest row``, because micro-batches are run as
dense ``[b, S]`` tensors: that is what bounds activation memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_agentic.config.errors import ConfigError
from mcore_agentic.parallel.cp_split import pad_to_multiple


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


__all__ = ["fixed_micro_batches", "scatter_rows", "token_budget_micro_batches"]
