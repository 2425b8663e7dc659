"""A new trajectory source is one class: a scripted source (in this file) under both schedules, unchanged.

The worked example docs/architecture.md's "Where to add things" points at. :class:`ScriptedSource`
(``tests/helpers/sources.py``, 90 lines) implements :class:`~mcore_agentic.rollout.source.TrajectorySource` and
nothing else: each session "samples" its row's scripted
ids, at most the round's token budget at a time, recording the weight version of each token. The feed's
:class:`FreshRounds` and :class:`PartialRounds` drive it through the real :class:`Roller` (whose ``new_source`` is the one
place a run chooses its source), score it, take its groups, and carry it through a checkpoint (one process: the
count tables are this leader's).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from mcore_agentic.feed.feed import Roller
from mcore_agentic.feed.fresh_rounds import FreshRounds
from mcore_agentic.feed.partial_rounds import PartialRounds
from mcore_agentic.feed.rounds import run_rounds
from mcore_agentic.feed.settings import FeedSettings
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rewards.config import OverlongBufferConfig
from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.utils.timing import PhaseTimer
from tests.helpers.sources import ROWS as SCRIPTED_ROWS
from tests.helpers.sources import ScriptedSource

ROWS = SCRIPTED_ROWS[:2]


@pytest.fixture(scope="module")
def tok():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def _roller(tok: Any, monkeypatch: Any, version: list[int]) -> Roller:
    cfg = RolloutConfig(prompt_length=16, response_length=16, n=2, seed=3)
    settings = FeedSettings(rollout=cfg, prompts_per_step=2, sequences_per_step=4, mini_batch_sizes=(4,), plan_seed=None,
                            seed=3, max_response_length=16, overlong_buffer=OverlongBufferConfig(), val_batch_size=None)
    placement = SimpleNamespace(is_leader=True, group_index=0, num_groups=1, split_rows=lambda rows: rows)
    roller = Roller(settings, placement=placement, engine=None, tools={}, interactions={}, executor=None, tokenizer=tok,
                    reward_fn=lambda *args: 1.0, timer=PhaseTimer(), version=lambda: version[0])
    monkeypatch.setattr(roller, "new_source", lambda cfg=None, *, partial=False: ScriptedSource())  # the run's choice
    return roller


def _responses(rollout: Any) -> list[list[int]]:
    rows = rollout.rows
    return [[int(t) for t, m in zip(r, mask) if m] for r, mask in zip(rows["responses"], rows["response_mask"])]


def test_fresh_rounds_roll_a_new_source_to_the_end(tok, monkeypatch):
    schedule = FreshRounds(_roller(tok, monkeypatch, [7]), None, pad_id=0)
    result = run_rounds(schedule, ROWS, 0, wanted=2, group_index=0, num_groups=1, draw=lambda: ROWS, max_batches=None)
    rollout = schedule.take(int(result.table[0, 0]), 0, result.rounds)
    s0, s1 = (r["extra_info"]["script"] for r in ROWS)
    assert result.rounds == 1 and _responses(rollout) == [s0, s0[:-2], s1, s1[:-2]]
    assert rollout.rows["seq_scores"].tolist() == [1.0] * 4 and rollout.rows["oldest_version"] == [7] * 4


def test_partial_rounds_carry_a_new_source_across_steps_and_a_checkpoint(tok, monkeypatch, tmp_path):
    version = [1]
    roller = _roller(tok, monkeypatch, version)
    schedule = PartialRounds(roller, None, pad_id=0, max_turns_per_step=None, max_tokens_per_step=4,
                             over_sampling_batches=0, prompts_per_batch=2)
    result = run_rounds(schedule, ROWS, 0, wanted=2, group_index=0, num_groups=1, draw=lambda: ROWS, max_batches=None)
    assert result.rounds == 2  # 6 scripted ids at 4 a round
    first = schedule.take(2, 0, result.rounds)
    assert _responses(first)[0] == ROWS[0]["extra_info"]["script"]
    assert first.rows["token_ages"][0].tolist()[:6] == [0] * 6  # one weight version for the whole step

    # The next step: its rows start, one round runs (4 of 6 ids: the odd sessions' 4 end), and the checkpoint takes
    # the even ones in flight.
    version[0] = 2
    schedule.begin(ROWS, 1, lambda: ROWS)
    schedule.round(1)
    schedule.save(tmp_path)
    restored = PartialRounds(roller, None, pad_id=0, max_turns_per_step=None, max_tokens_per_step=4,
                             over_sampling_batches=0, prompts_per_batch=2)
    restored.load(tmp_path)
    assert restored.buffer is not None and restored.buffer.live_sessions == 2
    version[0] = 3
    restored.begin([], 2, lambda: ROWS)  # nothing new: the buffer is full
    restored.version = 3
    assert restored.round(2) == (2, 0, 0)
    second = restored.take(2, 0, 1)
    ages = second.rows["token_ages"][0].tolist()[:6]
    assert _responses(second)[0] == ROWS[0]["extra_info"]["script"] and ages == [1, 1, 1, 1, 0, 0]
    assert second.metrics["rollout/partial_resumed"] == 2


def test_a_rollout_rank_ahead_of_the_trainer_starts_no_more_than_its_step_trains(tok, monkeypatch, tmp_path):
    """Separate placement with partial rollouts: a rollout rank generates step s while the trainer trains s-1, so its
    weights are one version behind the step's (``target_version``). With ``max_staleness=1`` nothing started then may
    wait for a later step (it would be trained two versions old): every session runs free, the groups left from the
    last step finish first, and the step's own batch waits, drawn, for a step that needs it, also across a
    checkpoint. Every trained token is at most one version old."""
    version = [1]
    roller = _roller(tok, monkeypatch, version)
    ahead = [0]
    roller.target_version = lambda step: version[0] + ahead[0]

    def schedule_of() -> PartialRounds:
        return PartialRounds(roller, None, pad_id=0, max_turns_per_step=None, max_tokens_per_step=4,
                             over_sampling_batches=1, prompts_per_batch=2, max_staleness=1)

    def step(s: PartialRounds, k: int) -> Any:
        result = run_rounds(s, ROWS, k, wanted=2, group_index=0, num_groups=1, draw=lambda: ROWS, max_batches=None)
        return s.take(2, 0, result.rounds)

    schedule = schedule_of()
    first = step(schedule, 0)  # weights current: budgets, and a batch over-sampled
    assert first.rows["token_ages"].max() == 0 and len(schedule.buffer.groups) == 2
    ahead[0] = 1  # from now on the engine holds the version before the step's
    second = step(schedule, 1)
    assert second.metrics["rollout/partial_rounds"] == 1  # one free round finished the groups left from step 0
    assert second.rows["token_ages"].max() <= 1 and not schedule.buffer.groups
    assert [(b[1], b[2]) for b in schedule.deferred] == [(1, 0)]  # step 1's batch, not started
    schedule.save(tmp_path)
    restored = schedule_of()
    restored.load(tmp_path)
    assert [(b[1], b[2]) for b in restored.deferred] == [(1, 0)]
    version[0] = 2
    third = step(restored, 2)  # step 1's batch starts (its seeds), step 2's waits
    assert third.rows["token_ages"].max() <= 1 and not restored.buffer.groups
    assert [(b[1], b[2]) for b in restored.deferred] == [(2, 0)]
    assert _responses(third)[0] == ROWS[0]["extra_info"]["script"]
