"""The launcher rejects a bad config with one ``error: <field>: <fix>`` line per problem and exit code 2, no traceback.

Run with ``python`` the launcher pre-flights before any worker starts: its exit code 2 is the process exit code
and nothing follows the lines. Under torchrun the workers exit 2 (torchrun reports ``exitcode: 2`` per worker
and itself exits 1 — it does not forward worker exit codes), and rank 0 alone prints the lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "launch" / "pretrain_rl.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)


def _torchrun(overrides: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return _run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(LAUNCHER), *overrides], cwd)


def _lines_naming(proc: subprocess.CompletedProcess, field: str) -> list[str]:
    return [line for line in (proc.stdout + "\n" + proc.stderr).splitlines() if field in line]


def _assert_no_worker_traceback(proc: subprocess.CompletedProcess) -> None:
    text = proc.stdout + proc.stderr
    assert not re.search(r'File ".*(launch/pretrain_rl\.py|mcore_agentic|megatron)', text), text[-3000:]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to the interpreter")
def test_tp_not_dividing_world_size(tmp_path):
    proc = _torchrun(["actor.tensor_model_parallel_size=3"], tmp_path)
    assert proc.returncode != 0
    assert re.search(r"exitcode\s*:\s*2", proc.stderr), proc.stderr[-3000:]  # each worker exited 2
    lines = _lines_naming(proc, "actor.tensor_model_parallel_size")
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: actor.tensor_model_parallel_size:") and "world size 2" in lines[0]
    _assert_no_worker_traceback(proc)


def test_direct_run_exits_2_with_one_line(tmp_path):
    proc = _run([sys.executable, str(LAUNCHER), "actor.tensor_model_parallel_size=3"], tmp_path)
    assert proc.returncode == 2
    # The pre-flight writes nothing (no Hydra log, no outputs/<date>/<time>/).
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()] == []
    output = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert output == [
        "error: actor.tensor_model_parallel_size: world size 1 is not divisible by TP*PP*CP = 3*1*1 = 3: "
        "choose sizes whose product divides 1 (divisors: 1)"
    ]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to the interpreter")
def test_tp_not_dividing_query_groups(tmp_path):
    from transformers import Qwen2Config

    model_dir = tmp_path / "tiny_gqa"
    Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1,
    ).save_pretrained(model_dir)
    proc = _torchrun(["actor.tensor_model_parallel_size=2", f"model.model_path={model_dir}"], tmp_path)
    assert proc.returncode != 0
    lines = _lines_naming(proc, "actor.tensor_model_parallel_size")
    assert len(lines) == 1, (lines, proc.stdout[-2000:], proc.stderr[-4000:])
    assert lines[0].startswith("error: actor.tensor_model_parallel_size: =2 does not divide")
    assert "num_query_groups (KV heads) = 1" in lines[0]
    _assert_no_worker_traceback(proc)


def test_unknown_override_key_is_named(tmp_path):
    proc = _run([sys.executable, str(LAUNCHER), "actor.tensor_model_paralel_size=2"], tmp_path)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: actor.tensor_model_paralel_size: unknown key")
    assert "actor.tensor_model_parallel_size" in lines[0]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to the interpreter")
def test_under_torchrun_an_unknown_key_is_said_once_not_once_per_rank(tmp_path):
    proc = _torchrun(["actor.tensor_model_paralel_size=2"], tmp_path)
    assert proc.returncode != 0
    assert len(_lines_naming(proc, "error: actor.tensor_model_paralel_size: unknown key")) == 1, proc.stderr[-3000:]


def test_the_launcher_reports_every_problem_at_once_and_starts_no_worker(tmp_path):
    """Several mistakes, one launch: every line at once, before torchrun (no ChildFailedError trailer), in seconds."""
    proc = _run([sys.executable, str(LAUNCHER), "--nproc_per_node", "2", "actor.tensor_model_parallel_size=3",
                 "data.train_batch_size=true", "trainer.logger=[console,wandb]", "rollout.multi_turn.tool_config_path=nope.yaml",
                 "trainer.total_trainig_steps=5"], tmp_path)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert all(line.startswith("error: ") for line in lines), lines
    fields = {line[len("error: "):].split(": ", 1)[0] for line in lines}
    # The unknown key and the wrong type together (the rules for the world size need a config that builds: they
    # come with the next launch, as in the test below).
    assert {"trainer.total_trainig_steps", "data.train_batch_size"} <= fields, lines
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_launcher_reports_config_problems_together(tmp_path):
    proc = _run([sys.executable, str(LAUNCHER), "--nproc_per_node", "2", "actor.tensor_model_parallel_size=3",
                 "trainer.logger=[console,wandb]", "rollout.multi_turn.tool_config_path=nope.yaml"], tmp_path)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    fields = {line[len("error: "):].split(": ", 1)[0] for line in lines}
    assert {"actor.tensor_model_parallel_size", "rollout.multi_turn.tool_config_path"} <= fields, lines
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        assert "trainer.logger" in fields
    assert all(line.startswith("error: ") for line in lines) and "Traceback" not in proc.stderr
    where = [line for line in lines if "rollout.multi_turn.tool_config_path" in line][0]
    assert f"nope.yaml not found (relative paths are looked up in: {tmp_path.resolve()}, {ROOT})" in where


def test_the_default_job_checks_out_from_any_directory(tmp_path):
    """Shipped configs name repository paths (configs/tools/...): they resolve from any working directory."""
    proc = _run([sys.executable, str(LAUNCHER), "--check", "--nproc_per_node", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "pre-flight passed: default_tiny on 2 rank(s)"
    # A verl script's trainer.n_gpus_per_node sets the world size when --nproc_per_node is not given.
    proc = _run([sys.executable, str(LAUNCHER), "--check", "trainer.n_gpus_per_node=2"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "pre-flight passed: default_tiny on 2 rank(s)"


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("trainer.device=cuda", "trainer.device", "cuda was asked for but torch sees no GPU"),
        ("model.transformer_impl=transformer_engine", "model.transformer_impl", "TransformerEngine is not installed"),
    ],
)
def test_accepted_keys_are_honoured_or_refused_in_one_line(tmp_path, override, field, words):
    if field == "model.transformer_impl":
        pytest.importorskip("torch")
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is not None:
            pytest.skip("TransformerEngine is installed here")
    proc = _run([sys.executable, str(LAUNCHER), override], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(output) == 1 and output[0].startswith(f"error: {field}: ") and words in output[0], output


@pytest.mark.timeout(400)
def test_a_stop_signal_to_the_launcher_saves_and_exits_75(tmp_path):
    """SIGTERM to ``python launch/pretrain_rl.py``: the workers finish the step, save, and the launcher exits 75
    with the run's one line (torchrun's own signal handling, and its traceback, stay out of it)."""
    import signal
    import time

    metrics = tmp_path / "logs" / "metrics.jsonl"
    cmd = [sys.executable, str(LAUNCHER), "--nproc_per_node", "2", "trainer.total_training_steps=20",
           "trainer.sft_warmup_steps=0", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.rollout_data_dir=null", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
           f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step was logged"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-4000:]
    assert "stopped on SIGTERM after step" in err and "Traceback" not in err and "ChildFailedError" not in err, err[-4000:]
    assert list((tmp_path / "ckpt").glob("global_step_*/COMPLETE"))
