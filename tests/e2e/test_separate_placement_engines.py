"""Separate placement end to end, the engines' side (``rollout.placement=separate``): vLLM's CPU build on two rollout
ranks (4 ranks in all), and a run resumed from a checkpoint that holds the rollout ranks' part (3 ranks).

A file of its own so that the test runner's two workers share separate placement's torchrun jobs
(``tests/e2e/test_separate_placement.py`` has the others).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_agentic.feed.rollout_dump import read_dump
from tests.e2e.test_default_job import job_overrides, launch, read_rows
from tests.e2e.test_resume import _assert_same_run


@pytest.mark.timeout(600)
def test_vllm_engine_ranks_sample_with_the_trainers_weights(tmp_path: Path) -> None:
    """4 ranks: 2 training and vLLM's CPU build on the other 2, fresh rounds: step 1's rows were sampled with the
    weights the trainer trains them with (its recomputed log-probs equal the engine's), later steps' one version
    older (the engines generated step s+1 while the trainer trained step s)."""
    overrides = ["rollout.placement=separate", "rollout.rollout_ranks=2", "rollout.name=vllm",
                 "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.plot_at_end=false",
                 "trainer.save_freq=-1", "trainer.test_freq=-1"]
    result = launch(job_overrides(tmp_path, overrides), nproc=4)
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
