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
from tests.e2e.test_resume import _assert_same_run

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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engines", [1, 2])
def test_vllm_engine_ranks_sample_with_the_trainers_weights(tmp_path: Path, engines: int) -> None:
    """2 ranks training and vLLM's CPU build on 1 or 2 more, fresh rounds: step 1's rows were sampled with the
    weights the trainer trains them with (its recomputed log-probs equal the engine's), later steps' one version
    older (the engines generated step s+1 while the trainer trained step s)."""
    overrides = ["rollout.placement=separate", f"rollout.rollout_ranks={engines}", "rollout.name=vllm",
                 "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.plot_at_end=false",
                 "trainer.save_freq=-1", "trainer.test_freq=-1"]
    result = launch(job_overrides(tmp_path, overrides), nproc=2 + engines)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = read_rows(tmp_path / "logs" / "metrics.jsonl")
    assert rows[1]["rollout/staleness_max"] == 0 and rows[1]["rollout/logprob_diff_max"] < 1e-4
    assert [rows[s]["rollout/staleness_max"] for s in (2, 3)] == [1.0, 1.0]


@pytest.mark.timeout(600)
def test_a_resumed_run_trains_what_the_uninterrupted_one_did(tmp_path: Path) -> None:
    """3 ranks (2 + a transformers engine), fresh rounds, a checkpoint every step. The step-2 checkpoint holds the
    rollout rank's part (its prompts' position and the step it had generated ahead, with the weights of step 2); a run
    resumed from it trains step 3 on the same rows, with the same metrics, as the uninterrupted run: nothing lost,
    nothing trained twice."""
    common = ["rollout.placement=separate", "rollout.rollout_ranks=1", "trainer.logger=[jsonl]",
              "trainer.progress_bar=false", "trainer.plot_at_end=false", "trainer.test_freq=-1",
              "trainer.rollout_data_freq=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    first = launch(job_overrides(a, [*common, "trainer.save_freq=1", f"trainer.rollout_data_dir={a / 'rollouts'}"]),
                   nproc=3)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert (a / "ckpt" / "global_step_2" / "rollout_ranks" / "engine_00000.pkl").is_file()
    resumed = launch(job_overrides(b, [*common, "trainer.save_freq=-1", f"trainer.rollout_data_dir={b / 'rollouts'}",
                                       f"trainer.resume_mode={a / 'ckpt' / 'global_step_2'}"]), nproc=3)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    rows_a, rows_b = read_rows(a / "logs" / "metrics.jsonl"), read_rows(b / "logs" / "metrics.jsonl")
    no_dumps = {3: {k: v for k, v in rows_a[3].items() if not k.startswith("dump/")}}
    _assert_same_run(no_dumps, {3: {k: v for k, v in rows_b[3].items() if not k.startswith("dump/")}}, steps=(3,))

    def trained(root: Path, step: int) -> list[tuple]:
        rows = [r for r in read_dump(root).to_pylist() if r["split"] == "train" and r["step"] == step]
        return sorted((r["uid"], tuple(r["response_ids"])) for r in rows)

    assert trained(b / "rollouts", 3) == trained(a / "rollouts", 3)
    assert not set(trained(a / "rollouts", 3)) & set(trained(a / "rollouts", 2))


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
