"""Shared e2e fixtures: one short run of the default job with trajectory dumps, reused by the dump and inspector tests."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_default_job import ROOT, job_overrides


@dataclass(frozen=True)
class DumpRun:
    dump_dir: Path
    records_dir: Path
    logs: Path
    stdout: str


@pytest.fixture(scope="session")
def default_job_dump(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> DumpRun:
    """Two RL steps of the default job on 2 gloo ranks (DP=2, two rollout engines), turn-level credit
    (``grpo_turn``, ``algorithm.turn_rewards``), with every step's rows and the step-2 validation dumped, and the
    rows each rank's actor update trained on recorded.

    Run once per test session: under pytest-xdist the first worker that needs it runs the job in the session's
    shared temporary directory, and the others wait on a file lock and read its result."""
    if not hasattr(request.config, "workerinput"):  # not an xdist worker
        return _run_default_job_dump(tmp_path_factory.mktemp("default_job_dump"))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "default_job_dump"
    with FileLock(str(shared) + ".lock"):
        done = shared / "stdout.txt"
        if not done.is_file():
            shared.mkdir(exist_ok=True)
            run = _run_default_job_dump(shared)
            done.write_text(run.stdout)
            return run
    return DumpRun(shared / "dump", shared / "trained", shared / "logs", done.read_text())


def _run_default_job_dump(tmp: Path) -> DumpRun:
    records = tmp / "trained"
    records.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RECORD_ROWS_DIR": str(records)}
    extra = [
        "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=-1",
        "trainer.logger=[console,jsonl]", f"trainer.rollout_data_dir={tmp / 'dump'}", "trainer.rollout_data_freq=1",
        # Turn-level credit through the whole path: per-turn rewards in the row exchange, the hand-off, the
        # experience and the dumps (the dump test compares the advantages the trainer trained on).
        "algorithm.adv_estimator=grpo_turn", "algorithm.turn_rewards=true",
    ]
    # A warm start long enough that the policy calls the tool: the dump then holds tool calls and results.
    # With the step-0 validation (the default job's baseline) as the default job has it.
    overrides = [o if not o.startswith("trainer.sft_warmup_steps=") else "trainer.sft_warmup_steps=120"
                 for o in job_overrides(tmp, extra)]
    overrides = [o.replace("val_before_train=false", "val_before_train=true") for o in overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "e2e" / "_record_trained_rows.py"), *overrides]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return DumpRun(tmp / "dump", records, tmp / "logs", result.stdout)
