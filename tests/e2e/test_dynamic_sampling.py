"""Dynamic sampling and over-long handling in the trainer (2 ranks, the shortened default job).

* A run with ``algorithm.filter_groups`` (metric ``score``, which DAPO's over-long penalty makes vary with
  length) needs several sampling rounds per step; resumed from its step-1 checkpoint, it reproduces step 2
  exactly: the loader's position counted every prompt the extra rounds consumed.
* ``algorithm.overlong_filtering`` with a response budget every response overruns: every row leaves the
  actor's loss (the policy gradient is 0) while the critic-free GRPO step still runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_default_job import job_overrides, launch, read_rows
from tests.e2e.test_resume import _assert_same_run

DYNAMIC = [
    "trainer.sft_warmup_steps=120",  # a policy whose samples sometimes differ (the 2-step warm start never answers)
    "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
    "algorithm.filter_groups.max_num_gen_batches=3",
    "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=16",
    "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.plot_at_end=false",
    "trainer.total_training_steps=2",
]


@pytest.mark.timeout(600)
def test_resume_after_a_step_of_several_sampling_rounds_reproduces_the_run(tmp_path: Path) -> None:
    a = tmp_path / "a"
    first = launch(job_overrides(a, [*DYNAMIC, "trainer.save_freq=1"]))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    rows_a = read_rows(a / "logs" / "metrics.jsonl")
    assert sorted(rows_a) == [1, 2]
    step1 = rows_a[1]
    # Step 1 needed more than one round of prompts: what the checkpoint's loader position must count.
    assert step1["rollout/sampling_rounds"] >= 2, step1
    for row in rows_a.values():
        rounds = row["rollout/sampling_rounds"]
        assert row["rollout/prompts_consumed"] == 4 * rounds  # data.train_batch_size prompts per round
        assert row["rollout/num_sequences"] == 8 * rounds  # every generated row counts in the rollout statistics
        assert row["rollout/informative_groups"] + row["rollout/filtered_groups"] == 4 * rounds
        assert row["rollout/filled_groups"] == max(0, 4 - row["rollout/informative_groups"])
    assert any(row["rollout/filtered_groups"] > 0 for row in rows_a.values())
    assert min(row["reward/overlong_penalty_mean"] for row in rows_a.values()) < 0

    b = tmp_path / "b"
    resumed = launch(job_overrides(b, [*DYNAMIC, "trainer.save_freq=-1",
                                       f"trainer.resume_mode={a / 'ckpt' / 'global_step_1'}"]))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    rows_b = read_rows(b / "logs" / "metrics.jsonl")
    assert sorted(rows_b) == [2]
    _assert_same_run({2: rows_a[2]}, rows_b, steps=(2,))


def test_overlong_filtering_takes_truncated_rows_out_of_the_actor_loss(tmp_path: Path) -> None:
    extra = [
        "data.max_response_length=6", "rollout.response_length=6",  # shorter than any answer: all truncated
        "algorithm.overlong_filtering=true", "trainer.sft_warmup_steps=0",  # no demonstration fits 6 tokens
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
    ]
    result = launch(job_overrides(tmp_path, extra))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    row = read_rows(tmp_path / "logs" / "metrics.jsonl")[1]
    assert row["rollout/truncated"] == 1.0
    assert row["actor/overlong_filtered_fraction"] == 1.0
    assert row["actor/pg_loss"] == 0.0 and row["actor/grad_norm"] == 0.0
