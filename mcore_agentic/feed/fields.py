"""The fields that cross the seam: one table of every per-row quantity a leader's rows carry to their replica.

A replica's rows (:class:`~mcore_agentic.feed.feed.ReplicaRows`) are the rollout layout (``prompts``, ``responses``,
``input_ids``, ``attention_mask``, ``position_ids``: :data:`mcore_agentic.data.batch.LAYOUT_KEYS`) plus the fields of
:data:`FIELDS`, and nothing else. Each entry says what the field is (dtype; per response token, per row, or per
token of the whole sequence), what a filler row holds, who writes it on the leader and which setting makes a run
want it. Everything that handles the fields reads this table and names none of them:

* the feed's settings carry the set of wanted fields (:func:`wanted_fields` of the run's config);
* the exchange (:mod:`.distribute`) sends exactly those, each in its dtype's buffer, in the table's order;
* filler rows (:func:`.distribute.filler_rows`) hold each field's :attr:`RowField.filler`;
* the hand-off (:meth:`~mcore_agentic.feed.feed.ReplicaRows.from_batch`) takes the table's fields and refuses any
  other tensor, or a field of another dtype;
* a dump step's return trip brings back :data:`RETURNED` (the trainer's per-token values, to the leaders' dumps).

**Adding a per-row field** is one :class:`RowField` here plus its producer (the code that writes the tensor into a
leader's rows before the hand-off); the trainer then reads ``batch[name]``. Model: slime's single key list at its
rollout -> train seam.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mcore_agentic.algorithms.estimators import estimator

__all__ = [
    "FIELDS", "FILLER_VERSION", "OWN", "RETURNED", "ROW0", "RowField", "always_fields", "bare_fields", "field_names",
    "select", "wanted_fields",
]

OWN = "own"
"""A filler row's value of an id field: an id of its own (the hand-off numbers the filler's own ``meta`` key)."""
ROW0 = "row 0"
"""A filler row's value of a field it copies from row 0, whose prompt it takes."""
FILLER_VERSION = -2
"""The ``weight_version`` of a filler row (a real row that sampled nothing has -1)."""

_BUFFER_DTYPES = {"response": (torch.long, torch.float32), "row": (torch.long, torch.float32), "token": (torch.int16,)}


@dataclass(frozen=True)
class RowField:
    """One per-row quantity that crosses the seam (module docstring)."""

    name: str
    dtype: torch.dtype
    per: Literal["response", "row", "token"]
    """``response``: ``[B, R]``, one value per response token (0 on padding); ``row``: ``[B]``; ``token``:
    ``[B, P+R, ...]`` aligned with ``input_ids`` (-1 on padding; int16, which the exchange packs four to an int64,
    its trailing shape given to it as ``routing_shape``)."""
    filler: int | float | str
    """A filler row's value: a number, :data:`OWN` or :data:`ROW0`."""
    producer: str
    """Who writes it into a leader's rows."""
    setting: str | None = None
    """What makes a run want it (None: every run)."""
    wanted: Callable[[Any], bool] | None = None
    """The same, of the run's config (``RLConfig``); None: every run."""
    meta: str | None = None
    """The leader's per-row list (``Batch.meta``) the hand-off makes the tensor from, when it makes it there: a
    filler row sets that list (to :attr:`filler`, or to names of its own for :data:`OWN`)."""
    doc: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in _BUFFER_DTYPES[self.per]:
            raise ValueError(f"row field {self.name}: a {self.per} field travels as one of "
                             f"{_BUFFER_DTYPES[self.per]}, not {self.dtype}")
        if (self.setting is None) != (self.wanted is None):
            raise ValueError(f"row field {self.name}: a setting needs its predicate on the config, and back")
        if isinstance(self.filler, str) and self.filler not in (OWN, ROW0):
            raise ValueError(f"row field {self.name}: a filler is a number, OWN or ROW0, not {self.filler!r}")
        if self.filler == OWN and self.meta is None:
            raise ValueError(f"row field {self.name}: an id of its own is numbered from a meta key")


def _estimator_reads(name: str) -> Callable[[Any], bool]:
    """The predicate of a field an advantage estimator may read: the run's estimator declares it in its
    ``row_fields`` (mcore_agentic/algorithms/estimators.py)."""
    return lambda cfg: name in estimator(cfg.algorithm.adv_estimator).row_fields


FIELDS: tuple[RowField, ...] = (
    # per response token ([B, R])
    RowField("response_mask", torch.long, "response", 0, "the rollout (its collation)",
             doc="the loss mask: 1 exactly on the tokens the policy sampled"),
    RowField("rollout_log_probs", torch.float32, "response", 0, "the rollout (the engine's log-probs)",
             doc="the engine's log-probs of the sampled tokens"),
    RowField("turn_rewards", torch.float32, "response", 0, "feed/scoring.py (score_rollout)",
             setting="algorithm.turn_rewards", wanted=lambda cfg: bool(cfg.algorithm.turn_rewards),
             doc="each assistant turn's own reward on its last sampled token; the rest of seq_scores is the "
                 "episode's (turns are the runs of the loss mask, so no boundaries travel: docs/algorithms.md)"),
    RowField("turn_states", torch.long, "response", 0, "feed/turn_states.py (Roller.score)",
             setting="an algorithm.adv_estimator that reads it (gigpo)", wanted=_estimator_reads("turn_states"),
             doc="1 + the id of the state each turn acted from, on the turn's sampled tokens"),
    RowField("token_ages", torch.long, "response", 0, "feed/partial_rounds.py (PartialRounds.take)",
             setting="rollout.partial_rollout.enable with algorithm.rollout_correction",
             wanted=lambda cfg: bool(cfg.rollout.partial_rollout.enable and cfg.algorithm.rollout_correction.enabled),
             doc="how many weight versions behind the step each sampled token is (the correction's metrics by age)"),
    # per row ([B])
    RowField("seq_scores", torch.float32, "row", 0, "feed/scoring.py (score_rollout)",
             doc="the row's score (rule reward + tool rewards + interaction score + over-long penalty)"),
    RowField("group_index", torch.long, "row", OWN, "feed/distribute.py (tag_groups, at the hand-off)", meta="uid",
             doc="a step-wide id of the row's prompt group (below the step's row count)"),
    RowField("truncated", torch.long, "row", 0, "feed/scoring.py (score_rollout)",
             doc="1 where the response budget cut the row"),
    RowField("weight_version", torch.long, "row", FILLER_VERSION, "feed/feed.py (Feed.hand_off)", meta="oldest_version",
             doc="the oldest weight version that sampled the row's tokens (-1: none; -2: a filler row, which trains "
                 "nothing and no data metric counts); older than the trainer's under partial rollouts"),
    RowField("episode_index", torch.long, "row", OWN, "feed/distribute.py (tag_episodes, at the hand-off)",
             setting="rollout.agent with train_samples=all",
             wanted=lambda cfg: bool(cfg.rollout.agent.enabled and cfg.rollout.agent.train_samples == "all"),
             meta="episode_id",
             doc="a step-wide id of the row's episode (the samples of one forked agent episode share it)"),
    RowField("turn_offset", torch.long, "row", 0, "feed/distribute.py (tag_episodes, at the hand-off)",
             setting="rollout.agent with train_samples=all",
             wanted=lambda cfg: bool(cfg.rollout.agent.enabled and cfg.rollout.agent.train_samples == "all"),
             meta="turn_offset",
             doc="the episode's turn index of the row's first turn (the turn-level estimators count from it)"),
    # per token of the whole sequence ([B, P+R, ...])
    RowField("routed_experts", torch.int16, "token", ROW0, "the rollout engine (its routers' choices)",
             setting="actor.moe.routing_replay", wanted=lambda cfg: cfg.actor.moe.routing_replay != "disable",
             doc="[B, P+R, moe_layers, top_k]: the experts the engine chose per token"),
)
"""Every field that crosses the seam, in the exchange's order."""

RETURNED = ("old_log_probs", "advantages", "ref_log_probs", "values", "token_level_scores", "token_level_rewards")
"""The way back (dump steps only): per-response-token float32 values the trainer computes on a replica's rows that
:func:`.distribute.return_rows` brings back to the leaders for their trajectory dumps."""


def field_names() -> frozenset[str]:
    """Every field of the table."""
    return frozenset(f.name for f in FIELDS)


def select(names: Collection[str]) -> tuple[RowField, ...]:
    """The table's entries named in ``names``, in the table's order; a name the table lacks is an error."""
    unknown = set(names) - field_names()
    if unknown:
        raise ValueError(f"no row field {sorted(unknown)} in the table (mcore_agentic/feed/fields.py)")
    return tuple(f for f in FIELDS if f.name in names)


def wanted_fields(cfg: Any) -> frozenset[str]:
    """The fields a run with config ``cfg`` (``RLConfig``) sends: every field of every run and each optional one
    whose setting is on."""
    return frozenset(f.name for f in FIELDS if f.wanted is None or f.wanted(cfg))


def always_fields() -> frozenset[str]:
    """The fields every run sends."""
    return frozenset(f.name for f in FIELDS if f.wanted is None)


def bare_fields() -> frozenset[str]:
    """What an exchange sends when not told (benches and tests of the exchange alone): every field of every run but
    ``weight_version``, which the feed's hand-off makes from the leader's ``oldest_version``."""
    return frozenset(f.name for f in FIELDS if f.wanted is None and f.name != "weight_version")

