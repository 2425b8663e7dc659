"""Dynamic sampling (DAPO): keep the prompt groups whose samples differ, over-sample until the step is full.

The filter of a step's rounds (:mod:`mcore_agentic.feed.rounds`), with either schedule: each rollout leader
sorts its complete, scored prompt groups into informative ones (the ``metric`` differs between samples that
acted) and spares (one value: zero group-relative advantage). With fresh rounds (:mod:`.fresh_rounds`) a
``GroupPool`` holds them for the step and the loop takes informative groups first, in rollout-group then round
order; with partial rollouts (:mod:`.partial_rounds`) the buffer holds them and the step is shared evenly over the
leaders. If the rounds ran out, spares fill the rest (``rollout/filled_groups``), so the step always trains a full
batch.
"""

from __future__ import annotations

from mcore_agentic.data.batch import Batch


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
