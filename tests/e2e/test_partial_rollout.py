"""Partial rollouts in the trainer (2 ranks, the shortened default job): agent programs held between steps at
their session's gate, and, with dynamic sampling, the built-in loop with 12 sampled tokens per request per round
(pauses inside turns).

The meter task's episodes take two turns (a tool call, then the answer). In the first test the source is the agent
program of ``examples/meter_agent.py`` through the session endpoint, under one assistant turn and 12 sampled tokens per
session per round: a program's request waits at its session's gate across the step (mid-generation when the token
budget cut its turn) and goes on in a later step under newer weights. A run of 3 steps is resumed from its step-2
checkpoint, taken with programs held: the resumed programs run again from their start, answered from the calls
their sessions recorded, and step 3 must come out exactly as in the uninterrupted run; every started prompt group is
trained once or still in flight at the end (none lost, none trained twice).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_agentic.feed.rollout_dump import read_dump
from tests.e2e.test_default_job import job_overrides, launch, read_rows
from tests.e2e.test_resume import _assert_same_run

PARTIAL = [
    "trainer.sft_warmup_steps=120", "trainer.total_training_steps=3",
    "rollout.partial_rollout.enable=true", "rollout.partial_rollout.max_turns_per_step=1",
    "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.plot_at_end=false",
]
PROMPTS, N = 4, 2  # SHORT: data.train_batch_size=4, rollout.n=2


def _conserved(rows: dict[int, dict], steps: list[int], held_before: float) -> None:
    """Groups started = groups trained + groups still buffered: nothing lost, nothing trained twice."""
    started = sum(rows[s]["rollout/partial_prompts_started"] for s in steps)
    assert held_before + started == PROMPTS * len(steps) + rows[steps[-1]]["rollout/partial_buffered_groups"]


AGENT = [*PARTIAL, "rollout.partial_rollout.max_tokens_per_step=12",
         "rollout.agent.entrypoint=examples/meter_agent.py:run", "rollout.multi_turn.tool_config_path=null"]


@pytest.mark.timeout(600)
def test_agent_programs_held_across_steps_resume_exactly(tmp_path: Path) -> None:
    a = tmp_path / "a"
    dumps = a / "rollouts"
    first = launch(job_overrides(a, [*AGENT, "trainer.save_freq=1", f"trainer.rollout_data_dir={dumps}",
                                     "trainer.rollout_data_freq=1"]))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    rows_a = read_rows(a / "logs" / "metrics.jsonl")
    assert sorted(rows_a) == [1, 2, 3]
    assert rows_a[2]["rollout/partial_paused"] > 0, rows_a[2]  # the step-2 checkpoint holds programs in flight
    assert max(rows_a[s]["rollout/partial_paused_mid_turn"] for s in (1, 2, 3)) > 0  # ... some mid-generation
    assert rows_a[3]["rollout/partial_resumed"] > 0
    assert max(rows_a[s]["rollout/oldest_token_age"] for s in (2, 3)) >= 1  # resumed under newer weights
    _conserved(rows_a, [1, 2, 3], 0)
    # Every trained row is a distinct request: no sample trained twice.
    table = read_dump(dumps).to_pylist()
    train = [r for r in table if r["split"] == "train"]
    assert len(train) == 3 * PROMPTS * N
    assert len({r["request_id"] for r in train}) == len(train)

    b = tmp_path / "b"
    resumed = launch(job_overrides(b, [*AGENT, "trainer.save_freq=-1",
                                       f"trainer.resume_mode={a / 'ckpt' / 'global_step_2'}"]))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    rows_b = read_rows(b / "logs" / "metrics.jsonl")
    no_dumps = {3: {k: v for k, v in rows_a[3].items() if not k.startswith("dump/")}}
    _assert_same_run(no_dumps, rows_b, steps=(3,))
    _conserved(rows_b, [3], rows_a[2]["rollout/partial_buffered_groups"])


# Partial rollouts with dynamic sampling and a token budget instead of the turn budget: requests pause inside
# their assistant turns and go on from their exact ids. The score varies with length (DAPO's over-long penalty),
# so some groups are informative and some are set aside, from groups that complete in different steps. Two extra
# batches in flight leave a step enough kept groups from the last one to stop after one round, with requests paused.
# The rollout correction's rejection band [0.5, 2] masks nothing here (the engine samples the trainer's policy up to
# float rounding, which the engine's batching decides): the loss stays bitwise reproducible across the resume while
# the correction reports the tokens by age.
FILTERED = [*PARTIAL, "rollout.partial_rollout.max_turns_per_step=null", "rollout.partial_rollout.max_tokens_per_step=12",
            "rollout.partial_rollout.over_sampling_batches=2", "algorithm.rollout_correction.rollout_rs=token",
            "algorithm.rollout_correction.rollout_rs_threshold=2.0",
            "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
            "algorithm.filter_groups.max_num_gen_batches=4",
            "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=16"]


def _conserved_with_filter(rows: dict[int, dict], steps: list[int], held_before: float) -> None:
    """Groups started = trained + still buffered + set aside (filtered and not used to fill)."""
    started = sum(rows[s]["rollout/partial_prompts_started"] for s in steps)
    set_aside = sum(rows[s]["rollout/filtered_groups"] - rows[s]["rollout/filled_groups"] for s in steps)
    assert held_before + started == PROMPTS * len(steps) + rows[steps[-1]]["rollout/partial_buffered_groups"] + set_aside


@pytest.mark.timeout(600)
def test_partial_rollouts_with_dynamic_sampling_resume_exactly(tmp_path: Path) -> None:
    a = tmp_path / "a"
    first = launch(job_overrides(a, [*FILTERED, "trainer.save_freq=1"]))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    rows_a = read_rows(a / "logs" / "metrics.jsonl")
    assert sorted(rows_a) == [1, 2, 3]
    assert rows_a[2]["rollout/partial_paused"] > 0, rows_a[2]  # the step-2 checkpoint holds requests in flight
    assert rows_a[2]["rollout/partial_paused_mid_turn"] > 0, rows_a[2]  # ... cut inside their turns
    # tokens sampled by older weights train, and the rollout correction reports them by age
    assert max(rows_a[s].get("rollout_corr/age_1/token_fraction", 0.0) for s in (2, 3)) > 0
    assert all(row["rollout/partial_trained_length_max"] > 0 for row in rows_a.values())
    assert sum(rows_a[s]["rollout/filtered_groups"] for s in (1, 2, 3)) > 0  # the filter set groups aside
    for row in rows_a.values():
        assert row["rollout/num_sequences"] >= PROMPTS * N  # trained rows and set-aside ones count in the statistics
    _conserved_with_filter(rows_a, [1, 2, 3], 0)

    b = tmp_path / "b"
    resumed = launch(job_overrides(b, [*FILTERED, "trainer.save_freq=-1",
                                       f"trainer.resume_mode={a / 'ckpt' / 'global_step_2'}"]))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    rows_b = read_rows(b / "logs" / "metrics.jsonl")
    _assert_same_run({3: rows_a[3]}, rows_b, steps=(3,))
    _conserved_with_filter(rows_b, [3], rows_a[2]["rollout/partial_buffered_groups"])
