"""Interrupt the shortened default job two ways, resume it, and compare with an uninterrupted run.

Run A (shared by both tests) trains 3 steps straight. On CPU every step is deterministic
(rollout seeds per step and rollout group, dataloader/RNG/model/optimizer state in the
checkpoint), so an interrupted and resumed run must reproduce A's metrics exactly, each
step logged exactly once. Excluded: wall-clock keys (``timing_s/*``, ``perf/*``); the
engine-vs-trainer log-prob gaps (``rollout/logprob_diff_*``, ~1e-7) are compared to 1e-5:
the engine's batching moves its log-probs in the last float bits (never the sampled tokens).

* SIGKILL: a checkpoint every step; the whole process group is killed while step 2's save
  is being written, i.e. after step 2's metrics line and before its checkpoint. The resume
  starts from step 1, drops the orphaned step-2 line and trains steps 2 and 3 again.
* SIGTERM (what Slurm sends before a preemption), no periodic checkpoints: the two ranks run
  as plain processes (as ``srun`` starts them), get SIGTERM twice (Slurm signals every
  process and torchrun forwards it once more) while step 2 runs; they finish the step, save,
  and exit with 75. The same command resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_agentic.trainer.preemption import EXIT_PREEMPTED
from tests.e2e.test_default_job import ROOT, SHORT
from tests.helpers.distributed import free_port

STEPS = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
         "trainer.progress_bar=false", "trainer.plot_at_end=false"]


def _args(tmp: Path, save_freq: int) -> list[str]:
    overrides = [o for o in SHORT if not o.startswith(("trainer.total_training_steps", "trainer.test_freq"))]
    return [
        "launch/pretrain_rl.py", "--config-name", "default_tiny", *overrides, *STEPS,
        f"trainer.save_freq={save_freq}", f"trainer.log_dir={tmp / 'logs'}", f"trainer.default_local_dir={tmp / 'ckpt'}",
    ]


def _cmd(tmp: Path, save_freq: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *_args(tmp, save_freq)]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _rows_once(path: Path) -> dict[int, dict]:
    """Every line parses and every step appears once (what a resume must leave behind)."""
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert record["step"] not in rows, f"step {record['step']} is logged twice"
        rows[record["step"]] = record
    return rows


NUMERIC_NOISE = ("rollout/logprob_diff_", "rollout_corr/")
"""Metrics of the engine's log-probs against the trainer's: fp32 float rounding, which the engine's batching (timing)
decides, so a resumed run matches them to 1e-5, not bitwise (the sampled ids and everything else bitwise)."""


SCHEDULING = ("rollout/prefix_cache_", "rollout/idle_fraction", "rollout/weight_loads")
"""What the engine served from its prefix cache: which requests were admitted together and which caches the engine
still held decide it (timing), not what was sampled; under separate placement, how long a rollout rank waited for the
trainer and how many versions it loaded between two answers (a resumed run sends the restored version once more)."""


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", *SCHEDULING, *NUMERIC_NOISE))}


def _noisy(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(NUMERIC_NOISE)}


def _assert_same_run(rows_a: dict, rows_b: dict, steps: tuple[int, ...] = (1, 2, 3)) -> None:
    assert sorted(rows_a) == list(steps) and sorted(rows_b) == list(steps)
    for step in steps:
        assert _comparable(rows_b[step]) == _comparable(rows_a[step]), f"step {step} differs after resume"
        assert _noisy(rows_b[step]) == pytest.approx(_noisy(rows_a[step]), abs=1e-5)


def _wait_for(condition, proc, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"the run never reached {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    a = tmp_path_factory.mktemp("uninterrupted")
    run = subprocess.run(_cmd(a, save_freq=-1) + ["trainer.resume_mode=disable"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-5000:]
    return _rows_once(a / "logs" / "metrics.jsonl")


@pytest.mark.timeout(600)
def test_kill_between_log_and_save_then_resume_reproduces_the_run(tmp_path: Path, uninterrupted) -> None:
    b = tmp_path / "b"
    proc = subprocess.Popen(_cmd(b, save_freq=1), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    staging = b / "ckpt" / ".tmp_global_step_2"  # step 2 is logged, its save has begun
    try:
        _wait_for(staging.exists, proc, "the step-2 save")
    finally:
        _kill_tree(proc)
    assert not (b / "ckpt" / "global_step_2" / "COMPLETE").exists(), "the kill came too late: step 2 was saved"
    logged = [json.loads(line)["step"] for line in (b / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]  # the orphaned line that the resume must drop

    resumed = subprocess.run(_cmd(b, save_freq=1), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    said = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "resumed from" in line or "warning:" in line]
    assert len(said) == 1 and said[0].endswith("global_step_1 at step 1"), said
    _assert_same_run(uninterrupted, _rows_once(b / "logs" / "metrics.jsonl"))
    assert (b / "ckpt" / "global_step_3" / "COMPLETE").exists()

    # The same command once more: the run is complete; it says so instead of reprinting a summary as if it trained.
    again = subprocess.run(_cmd(b, save_freq=1), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-5000:]
    assert f"already complete at step 3 ({b / 'ckpt' / 'global_step_3'}): nothing to do" in again.stdout
    assert "finished" not in again.stdout and "mean reward" not in again.stdout
    assert len(_rows_once(b / "logs" / "metrics.jsonl")) == 3  # nothing logged, nothing moved aside

    # The trained actor exports to a Hugging Face checkpoint that transformers loads.
    _check_export(b / "ckpt" / "global_step_3", tmp_path / "hf")


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (they run in sessions of their own, so killpg misses them)."""
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def _rank_env(rank: int, port: int) -> dict[str, str]:
    return {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.mark.timeout(600)
def test_sigterm_mid_step_checkpoints_exits_75_and_resumes_exactly(tmp_path: Path, uninterrupted) -> None:
    c = tmp_path / "c"
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, *_args(c, save_freq=-1)], cwd=ROOT, env=_rank_env(r, port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for r in (0, 1)
    ]
    metrics = c / "logs" / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, procs[0], "step 1's metrics")
        for _ in range(2):  # Slurm signals every process, torchrun forwards once more: one preemption, two deliveries
            for p in procs:
                p.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], outputs[0][1][-3000:]
    saved = sorted(int(d.name.rsplit("_", 1)[1]) for d in (c / "ckpt").glob("global_step_*"))
    assert len(saved) == 1 and saved[0] in (1, 2), saved  # the step running when the signal came (or just ending)
    step = saved[0]
    assert (c / "ckpt" / f"global_step_{step}" / "COMPLETE").exists()
    stderr0 = outputs[0][1]
    assert f"stopped on SIGTERM after step {step}: checkpoint {c / 'ckpt' / f'global_step_{step}'}" in stderr0
    assert "Traceback" not in stderr0 and "second SIGTERM" not in stderr0

    resumed = subprocess.run(_cmd(c, save_freq=-1), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    said = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "resumed from" in line or "warning:" in line]
    assert len(said) == 1 and said[0].endswith(f"global_step_{step} at step {step}"), said
    _assert_same_run(uninterrupted, _rows_once(metrics))


def _check_export(step_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf import load_hf_state_dict

    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "launch/export_hf.py", "--checkpoint", str(step_dir), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-5000:]
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    base_dir = ROOT / json.loads((step_dir / "config.json").read_text())["model"]["model_path"]
    base = load_hf_state_dict(base_dir)
    exported = load_hf_state_dict(out)
    assert sorted(exported) == sorted(base)
    assert all(exported[k].shape == base[k].shape for k in base)
    # SFT + 3 RL steps moved the weights away from the random initialisation.
    assert any(not torch.equal(exported[k], base[k]) for k in base)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
