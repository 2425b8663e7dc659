"""Separate placement end to end (``rollout.placement=separate``): a torchrun job of 4 ranks, 2 training (DP=2) and 2
generating (two transformers engines), on the shortened default job, with partial rollouts under a 12-token budget
(sessions pause mid-turn and the weights that arrive meanwhile load between rounds) and ``max_staleness=1``: the
engines generate each step one version ahead of the trainer, so no row may wait for a later step.

What must hold: every step trains rows no older than the bound (the rollout ranks run ahead of the trainer, so some
are older than the trainer's weights); every trained row is a distinct request, dumped once on its engine's rank with
the trainer's values (the return trip over the link); validation runs on both engines; the run exits 0 and the
rollout ranks stop with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_agentic.feed.rollout_dump import read_dump
from tests.e2e.test_default_job import job_overrides, launch, read_rows

SEPARATE = [
    "rollout.placement=separate", "rollout.rollout_ranks=2", "rollout.max_staleness=1",
    "rollout.partial_rollout.enable=true", "rollout.partial_rollout.max_tokens_per_step=12",
    "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.plot_at_end=false", "trainer.save_freq=-1",
    "trainer.rollout_data_freq=1",
]
PROMPTS, N, STEPS = 4, 2, 3


AGENT = ["rollout.agent.entrypoint=examples/meter_agent.py:run", "rollout.multi_turn.tool_config_path=null"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["loop", "agent"])
def test_two_trainer_ranks_train_what_two_engine_ranks_stream(tmp_path: Path, source: str) -> None:
    """``agent``: the rows come from agent programs (``examples/meter_agent.py``) through each engine rank's session
    endpoint, their requests held at their sessions' gates between rounds."""
    dumps = tmp_path / "rollouts"
    extra = AGENT if source == "agent" else []
    result = launch(job_overrides(tmp_path, [*SEPARATE, *extra, f"trainer.rollout_data_dir={dumps}"]), nproc=4)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = read_rows(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(s for s in rows if s) == [1, 2, 3]
    ages = [rows[s]["rollout/staleness_max"] for s in (1, 2, 3)]
    # Bounded, and the engines ran ahead of the trainer. A session started under weights already one version
    # behind the step's runs to its end in that step: paused, it would be trained two versions old.
    assert max(ages) == 1, ages
    assert all(rows[s]["rollout/weight_loads"] >= 1 for s in (2, 3))
    # Step 1 (the engines' weights the trainer's) ran in rounds of 12 tokens: turns cut and resumed. Later steps, one
    # version ahead, run every session to its end and start no more groups than they train (nothing waits a step).
    assert rows[1]["rollout/partial_rounds"] > 1
    assert [rows[s]["rollout/partial_buffered_groups"] for s in (2, 3)] == [0, 0]
    assert "val/reward/mean" in rows[2]

    table = read_dump(dumps).to_pylist()
    train = [r for r in table if r["split"] == "train"]
    assert len(train) == STEPS * PROMPTS * N
    assert len({r["request_id"] for r in train}) == len(train)  # nothing trained twice
    assert {r["group"] for r in train} == {0, 1}  # each engine dumps its own rows
    for r in train:  # the trainer's values came back over the link, one per response token
        assert r["old_log_probs"] is not None and len(r["old_log_probs"]) == len(r["response_ids"])
        assert r["advantages"] is not None and len(r["advantages"]) == len(r["response_ids"])
    val = [r for r in table if r["split"] == "val"]
    val_steps = sorted({r["step"] for r in val})
    assert val_steps == [s for s in (1, 2, 3) if "val/reward/mean" in rows[s]]
    assert len(val) == 8 * len(val_steps) and {r["group"] for r in val} == {0, 1}  # 8 prompts over both engines


@pytest.mark.timeout(300)
def test_a_failing_rollout_rank_stops_the_run_with_its_error(tmp_path: Path) -> None:
    """The reward function raises on the rollout rank (3 ranks, 2 + 1): the rank answers the trainer's request with
    its error line and the trainer stops with it, in seconds; nobody waits out the collectives' timeout."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise ValueError('the grader is broken')\n")
    overrides = ["rollout.placement=separate", "rollout.rollout_ranks=1", "trainer.logger=[jsonl]",
                 "trainer.progress_bar=false", "trainer.plot_at_end=false", "trainer.save_freq=-1",
                 "trainer.test_freq=-1", f"reward.custom_reward_function={reward}:compute_score"]
    result = launch(job_overrides(tmp_path, overrides), nproc=3, timeout=240)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "error: rollout engine 1 failed at step 1: ValueError: the grader is broken" in out, out[-5000:]
