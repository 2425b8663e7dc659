"""Dynamic sampling (DAPO): keep the prompt groups whose samples differ, over-sample until the step is full.

The filter of a step's rounds (:mod:`mcore_agentic.feed.rounds`), with either schedule: each rollout leader
sorts its complete, scored prompt groups into informative ones (the ``metric`` differs between samples that
acted) and spares (one value: zero group-relative advantage). With fresh rounds (:mod:`.fresh_rounds`) a
:class:`GroupPool` holds them for the step and :func:`allocate` takes informative groups first, in rollout-group
then round order; with partial rollouts (:mod:`.partial_rounds`) the buffer holds them and :func:`allocate_even`
shares the step over the leaders. If the rounds ran out, spares fill the rest (``rollout/filled_groups``), so
the step always trains a full batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mcore_agentic.data.batch import Batch, repad_rollout_layout


def group_rows(batch: Batch) -> list[list[int]]:
    """Row indices of each prompt group (rows sharing a ``uid``), groups in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(batch["uid"]):
        groups.setdefault(uid, []).append(i)
    return list(groups.values())


def metric_values(batch: Batch, metric: str) -> list[float]:
    """Each row's value of ``algorithm.filter_groups.metric``: ``acc``, or ``score``/``seq_reward`` (the sequence score)."""
    if metric == "acc":
        return [float(a) for a in batch["acc"]]
    if metric in ("score", "seq_reward"):
        return batch["seq_scores"].tolist()
    raise ValueError(f"unknown filter metric {metric!r}")


def informative(batch: Batch, metric: str) -> list[bool]:
    """Per prompt group (in :func:`group_rows` order): does ``metric`` vary over the samples that acted?

    A sample acted when it sampled at least one token (``response_mask``); a failed request did not and,
    as in the group baseline of the advantage, does not count. A group with fewer than two actors has
    zero advantage for every row, so it is not informative.
    """
    values = metric_values(batch, metric)
    acted = (batch["response_mask"].sum(dim=-1) > 0).tolist()
    out = []
    for rows in group_rows(batch):
        seen = {values[i] for i in rows if acted[i]}
        out.append(sum(acted[i] for i in rows) >= 2 and len(seen) > 1)
    return out


def allocate(available: Sequence[int], wanted: int) -> list[int]:
    """How many of each rollout group's ``available`` groups to take, in rollout-group order, ``wanted`` in all."""
    out, left = [], wanted
    for n in available:
        take = min(int(n), left)
        out.append(take)
        left -= take
    if left:
        raise ValueError(f"{wanted} groups wanted but only {sum(available)} available")
    return out


def allocate_even(available: Sequence[int], wanted: int) -> list[int]:
    """``wanted`` groups taken as evenly as ``available`` allows over the rollout groups (water-filling; the
    remainder goes to the first ones): no leader's groups wait while another's train (partial rollouts)."""
    take = [0] * len(available)
    left = wanted
    while left:
        open_ = [g for g, n in enumerate(available) if take[g] < n]
        if not open_:
            raise ValueError(f"{wanted} groups wanted but only {sum(available)} available")
        share = max(1, left // len(open_))
        for g in open_:
            add = min(share, int(available[g]) - take[g], left)
            take[g] += add
            left -= add
            if not left:
                break
    return take


def concat_rollouts(batches: Sequence[Batch], pad_token_id: int) -> Batch:
    """Rows of rollout batches with different padded widths, in order, re-padded to the widest."""
    batches = [b for b in batches if len(b)]
    if not batches:
        raise ValueError("no rows to concatenate")
    p = max(b["prompts"].shape[1] for b in batches)
    r = max(b["responses"].shape[1] for b in batches)
    same = [
        Batch(repad_rollout_layout(b.tensors, pad_token_id=pad_token_id, prompt_width=p, response_width=r),
              meta=b.meta, info=b.info)
        for b in batches
    ]
    return Batch.concat(same)


@dataclass
class GroupPool:
    """A rollout leader's scored groups over one step's rounds: informative ones and spares, in round order.
    ``metric`` None: no filter, every group is kept."""

    metric: str | None
    kept: list[Batch] = field(default_factory=list)
    spare: list[Batch] = field(default_factory=list)
    kept_groups: int = 0
    spare_groups: int = 0

    def add(self, batch: Batch) -> tuple[int, int]:
        """Sort ``batch``'s groups into the pool; returns (informative, spare) group counts of this round."""
        groups = group_rows(batch)
        flags = informative(batch, self.metric) if self.metric is not None else [True] * len(groups)
        keep = [i for rows, ok in zip(groups, flags) if ok for i in rows]
        drop = [i for rows, ok in zip(groups, flags) if not ok for i in rows]
        if keep:
            self.kept.append(batch.index(keep))
        if drop:
            self.spare.append(batch.index(drop))
        self.kept_groups += sum(flags)
        self.spare_groups += len(flags) - sum(flags)
        return sum(flags), len(flags) - sum(flags)

    def take(self, kept: int, spare: int, pad_token_id: int) -> Batch | None:
        """The first ``kept`` informative groups then the first ``spare`` spares, as one batch (None if none)."""
        parts = _first_groups(self.kept, kept) + _first_groups(self.spare, spare)
        return concat_rollouts(parts, pad_token_id) if parts else None


def _first_groups(batches: list[Batch], count: int) -> list[Batch]:
    out = []
    for b in batches:
        if count <= 0:
            break
        groups = group_rows(b)[:count]
        out.append(b.index([i for rows in groups for i in rows]))
        count -= len(groups)
    return out


def counts_tensor(num_groups: int, index: int, kept: int, spare: int) -> torch.Tensor:
    """This rank's row of the round's count table: ``[num_groups, 2]`` zeros but its own group's (kept, spare)."""
    t = torch.zeros(num_groups, 2, dtype=torch.long)
    t[index] = torch.tensor([kept, spare])
    return t
