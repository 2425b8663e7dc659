"""Kill the shortened default job right after its step-2 checkpoint, resume it, and compare with an uninterrupted run.

Run A trains 3 steps straight. Run B is the same job with a checkpoint every step:
it is SIGKILLed as soon as ``global_step_1`` is complete, then relaunched with
``trainer.resume_mode=auto``. On CPU every step is deterministic (rollout seeds per step
and DP rank, dataloader/RNG/model/optimizer state in the checkpoint), so B's steps 2 and 3
must reproduce A's metrics exactly. Excluded: wall-clock keys (``timing_s/*``, ``perf/*``),
and the engine-vs-trainer log-prob gaps (``rollout/logprob_diff_*``, ~1e-7) are compared to
1e-5: the HF engine's continuous batching groups requests by arrival time, which moves its
log-probs in the last float bits (never the sampled tokens) from run to run.
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

from tests.e2e.test_default_job import ROOT, SHORT

STEPS = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
         "trainer.progress_bar=false", "trainer.plot_at_end=false"]


def _cmd(tmp: Path, save_freq: int) -> list[str]:
    overrides = [o for o in SHORT if not o.startswith(("trainer.total_training_steps", "trainer.test_freq"))]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "launch/pretrain_rl.py", "--config-name", "default_tiny", *overrides, *STEPS,
        f"trainer.save_freq={save_freq}", f"trainer.log_dir={tmp / 'logs'}", f"trainer.default_local_dir={tmp / 'ckpt'}",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _rows(path: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        rows[record["step"]] = record  # a re-logged step: the later record wins
    return rows


NUMERIC_NOISE = "rollout/logprob_diff_"


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", NUMERIC_NOISE))}


def _noisy(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(NUMERIC_NOISE)}


@pytest.mark.timeout(600)
def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    run_a = subprocess.run(_cmd(a, save_freq=-1) + ["trainer.resume_mode=disable"], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert run_a.returncode == 0, run_a.stderr[-5000:]

    # Run B: killed (SIGKILL, whole process group) once the step-1 checkpoint is complete.
    proc = subprocess.Popen(_cmd(b, save_freq=1), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = b / "ckpt" / "global_step_1" / "COMPLETE"
    deadline = time.monotonic() + 300
    try:
        while not marker.exists():
            assert proc.poll() is None, f"run B exited ({proc.returncode}) before its step-1 checkpoint"
            assert time.monotonic() < deadline, "run B never wrote its step-1 checkpoint"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (b / "ckpt" / "global_step_3").exists()

    resumed = subprocess.run(_cmd(b, save_freq=1), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resumed from" in resumed.stderr + resumed.stdout

    rows_a, rows_b = _rows(a / "logs" / "metrics.jsonl"), _rows(b / "logs" / "metrics.jsonl")
    assert sorted(rows_a) == [1, 2, 3] and sorted(rows_b) == [1, 2, 3]
    for step in (1, 2, 3):
        assert _comparable(rows_b[step]) == _comparable(rows_a[step]), f"step {step} differs after resume"
        assert _noisy(rows_b[step]) == pytest.approx(_noisy(rows_a[step]), abs=1e-5)
    assert (b / "ckpt" / "global_step_3" / "COMPLETE").exists()

    # The trained actor exports to a Hugging Face checkpoint that transformers loads.
    _check_export(b / "ckpt" / "global_step_3", tmp_path / "hf")


def _check_export(step_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from mcore_agentic.models.hf_io import load_hf_state_dict

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
