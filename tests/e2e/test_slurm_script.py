"""slurm/train_multinode.sh under a fake Slurm: the exact srun/torchrun/ray commands it issues."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "train_multinode.sh"

# Each fake appends "<name>\t<arg>\t<arg>..." to $FAKE_LOG in one write: the Ray head's srun runs in
# the background beside `ray status`, and a line written in pieces could be split by the other's.
_RECORDER = """#!/bin/bash
line=$(basename "$0"); printf -v args '\\t%s' "$@"; printf '%s\\n' "$line$args" >> "$FAKE_LOG"
"""
# Like the real ones, background `ray start --block` steps run until killed, `ray status` only
# succeeds once a head was started, and the training step (here: instant) starts after the Ray
# workers were launched (FAKE_WAIT_FOR names a pattern it waits for in the log).
_SRUN = _RECORDER + """
for a in "$@"; do [[ "$a" == --block ]] && exec sleep 60; done
if [[ -n "${FAKE_WAIT_FOR:-}" && " $* " == *" torchrun "* ]]; then
    for _ in $(seq 1 200); do grep -q -- "$FAKE_WAIT_FOR" "$FAKE_LOG" && break; sleep 0.05; done
fi
if [[ -n "${FAKE_TRAIN_RUNS:-}" && " $* " == *" torchrun "* ]]; then
    # Training that runs until a signal reaches it, like torchrun: then the ranks save and it exits.
    trap 'printf "srun\\tgot\\tUSR1\\n" >> "$FAKE_LOG"; exit 75' USR1
    trap 'printf "srun\\tgot\\tTERM\\n" >> "$FAKE_LOG"; exit 1' TERM
    echo $$ > "$FAKE_LOG.train_pid"
    for _ in $(seq 1 600); do sleep 0.1; done
fi
"""
_RAY = _RECORDER + """
if [[ "$1" == status ]]; then grep -q -- "--head" "$FAKE_LOG"; fi
"""
_SCONTROL = _RECORDER + """
if [[ "$1 $2" == "show hostnames" ]]; then printf 'gpu-node-07\\ngpu-node-08\\ngpu-node-09\\n'; fi
if [[ "$1" == requeue && -n "${FAKE_REQUEUE_FAILS:-}" ]]; then exit 1; fi
"""


# torchrun is only asked for its --help on the batch node (which options it has); FAKE_OLD_TORCHRUN=1
# plays one from before --signals-to-handle / --shutdown-timeout.
_TORCHRUN = _RECORDER + """
if [[ "$1" == --help ]]; then
    echo "usage: torchrun [--nnodes NNODES] [--rdzv-endpoint RDZV_ENDPOINT]"
    if [[ -z "${FAKE_OLD_TORCHRUN:-}" ]]; then echo "  [--signals-to-handle SIGNALS_TO_HANDLE] [--shutdown-timeout SHUTDOWN_TIMEOUT]"; fi
fi
"""


# The pre-flight (launch/pretrain_rl.py --check); FAKE_PREFLIGHT_FAILS=1 plays a bad config.
_PYTHON = _RECORDER + """
if [[ -n "${FAKE_PREFLIGHT_FAILS:-}" ]]; then echo "error: data.train_files: x.parquet not found" >&2; exit 2; fi
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", _SRUN), ("ray", _RAY), ("scontrol", _SCONTROL), ("torchrun", _TORCHRUN),
                       ("python", _PYTHON)):
        path = bin_dir / name
        path.write_text(body)
        path.chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, *overrides: str, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    log = tmp_path / "calls.log"
    full_env = {
        "PATH": f"{_fake_bin(tmp_path)}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(log),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "rl-test",
        "SLURM_JOB_NODELIST": "gpu-node-[07-09]",
        "SLURM_NNODES": "3",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_SUBMIT_DIR": str(REPO),
        "LOG_ROOT": str(tmp_path / "logs"),
        **env,
    }
    result = subprocess.run(["bash", str(SCRIPT), *overrides], env=full_env, capture_output=True, text=True, timeout=60)
    calls = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_torchrun_command_and_log_dir(tmp_path):
    overrides = ("--config-name", "gsm8k_multiturn_grpo", "model=qwen2_5_7b", "rollout.n=8", "trainer.experiment_name=a b")
    result, calls = _run(tmp_path, *overrides)
    assert result.returncode == 0, result.stderr
    log_dir = tmp_path / "logs" / "rl-test-4242"
    assert log_dir.is_dir()
    assert calls[0] == ["scontrol", "show", "hostnames", "gpu-node-[07-09]"]
    calls = [c for c in calls if c[0] != "torchrun"]  # its --help, asked on the batch node
    sruns = [c for c in calls if c[0] == "srun"]
    assert len(sruns) == 1 and not any(c[0] == "ray" for c in calls)
    port = str(29500 + 4242 % 10000)
    assert sruns[0] == [
        "srun", "--overlap", "--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--open-mode=append",
        f"--output={log_dir}/train-%N.log",
        "torchrun", "--nnodes", "3", "--nproc_per_node", "4", "--rdzv_id", "4242",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"gpu-node-07:{port}",
        "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "900",
        "launch/pretrain_rl.py", *overrides, f"trainer.log_dir={log_dir}",
    ]  # the override with a space survives as one argument
    assert not any(c[:2] == ["scontrol", "requeue"] for c in calls)  # a run that ends by itself is not requeued
    assert f"rendezvous gpu-node-07:{port}" in result.stdout
    # The pre-flight ran first, for the whole world, with the same overrides.
    checks = [c for c in calls if c[0] == "python"]
    assert checks == [["python", "launch/pretrain_rl.py", "--check", "--nnodes", "3", "--nproc_per_node", "4",
                       *overrides, f"trainer.log_dir={log_dir}"]]
    assert calls.index(checks[0]) < calls.index(sruns[0])


def test_a_failed_preflight_starts_nothing(tmp_path):
    result, calls = _run(tmp_path, "data.train_files=x.parquet", FAKE_PREFLIGHT_FAILS="1")
    assert result.returncode == 2
    assert "error: data.train_files: x.parquet not found" in result.stderr
    assert not any(c[0] in ("srun", "ray") for c in calls) and not any(c[:2] == ["scontrol", "requeue"] for c in calls)


def test_explicit_log_dir_port_and_gpu_count_from_slurm_gpus_per_node(tmp_path):
    env = {"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:8", "MASTER_PORT": "31000"}
    result, calls = _run(tmp_path, "trainer.log_dir=/shared/run1", **env)
    assert result.returncode == 0, result.stderr
    torchrun = next(c for c in calls if c[0] == "srun")
    args = torchrun[torchrun.index("torchrun") :]
    assert args[args.index("--nproc_per_node") + 1] == "8"
    assert args[args.index("--rdzv_endpoint") + 1] == "gpu-node-07:31000"
    assert args[-1] == "trainer.log_dir=/shared/run1"  # not overridden a second time


def test_ray_tool_pool_head_and_workers(tmp_path):
    result, calls = _run(tmp_path, "rollout.n=4", RAY_TOOL_POOL="1", RAY_PORT="6380", FAKE_WAIT_FOR="start\t--address=")
    assert result.returncode == 0, result.stderr
    log_dir = tmp_path / "logs" / "rl-test-4242"
    sruns = [c for c in calls if c[0] == "srun"]
    head = next(c for c in sruns if "--head" in c)
    assert head[head.index("ray") :] == [
        "ray", "start", "--head", "--node-ip-address=gpu-node-07", "--port=6380", "--num-gpus=0", "--block",
    ]
    assert "-w" in head and head[head.index("-w") + 1] == "gpu-node-07"
    workers = next(c for c in sruns if "--address=gpu-node-07:6380" in c and "start" in c)
    assert "--nodes=2" in workers and "--exclude=gpu-node-07" in workers
    assert ["ray", "status", "--address=gpu-node-07:6380"] in calls  # waited for the head
    train = next(c for c in sruns if "torchrun" in c)
    assert train[train.index("launch/pretrain_rl.py") + 1 :] == [
        "rollout.n=4", f"trainer.log_dir={log_dir}", "rollout.multi_turn.tool_executor=ray",
    ]


@pytest.mark.parametrize("missing", ["SLURM_JOB_ID", "SLURM_JOB_NODELIST"])
def test_refuses_to_run_outside_slurm(tmp_path, missing):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{_fake_bin(tmp_path)}:/usr/bin:/bin", FAKE_LOG=str(tmp_path / "calls.log"))
    env.update({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"})
    env.pop(missing)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and missing in result.stderr
    assert not (tmp_path / "calls.log").exists()


def test_an_old_torchrun_gets_no_signal_options_and_a_warning(tmp_path):
    result, calls = _run(tmp_path, "rollout.n=2", FAKE_OLD_TORCHRUN="1")
    assert result.returncode == 0, result.stderr
    train = next(c for c in calls if c[0] == "srun" and "torchrun" in c)
    assert "--signals-to-handle" not in train and "--shutdown-timeout" not in train
    assert "cannot forward SIGUSR1" in result.stderr and "kills the ranks 30 s after" in result.stderr


def test_header_asks_for_the_warning_signal_requeue_and_appending_logs():
    header = [line.split(None, 1)[1] for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "--signal=B:USR1@600" in header  # SIGUSR1 to the batch script 10 minutes before the time limit
    assert "--requeue" in header and "--open-mode=append" in header


def _start(tmp_path: Path, **env: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "calls.log"
    full_env = {
        "PATH": f"{_fake_bin(tmp_path)}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_LOG": str(log),
        "FAKE_TRAIN_RUNS": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "rl-test", "SLURM_JOB_NODELIST": "gpu-node-[07-09]",
        "SLURM_NNODES": "3", "SLURM_GPUS_ON_NODE": "4", "SLURM_SUBMIT_DIR": str(REPO), "LOG_ROOT": str(tmp_path / "logs"),
        **env,
    }
    proc = subprocess.Popen(["bash", str(SCRIPT), "rollout.n=2"], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pid_file = Path(f"{log}.train_pid")
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return proc, log


def _calls(log: Path) -> list[list[str]]:
    return [line.split("\t") for line in log.read_text().splitlines()]


@pytest.mark.parametrize("requeue", ["1", "0", "fails"])
def test_time_limit_warning_is_forwarded_then_the_job_requeued(tmp_path, requeue):
    env = {"REQUEUE": "1", "FAKE_REQUEUE_FAILS": "1"} if requeue == "fails" else {"REQUEUE": requeue}
    proc, log = _start(tmp_path, **env)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@600 does
    out, err = proc.communicate(timeout=30)
    calls = _calls(log)
    assert ["srun", "got", "USR1"] in calls  # forwarded to the training step
    assert proc.returncode == 75  # the training step's own exit status, even when the requeue fails
    requeued = ["scontrol", "requeue", "4242"] in calls
    assert requeued == (requeue != "0"), out + err
    assert "SIGUSR1: the time limit is near" in out
    assert ("scontrol requeue 4242 failed" in err) == (requeue == "fails")


def test_sigterm_waits_for_the_ranks_and_leaves_requeue_to_slurm(tmp_path):
    proc, log = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)  # preemption: Slurm signals the steps itself
    time.sleep(0.5)
    assert proc.poll() is None, "the script must keep waiting while the ranks checkpoint"
    os.kill(int(Path(f"{log}.train_pid").read_text()), signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    calls = _calls(log)
    assert ["srun", "got", "TERM"] in calls and ["srun", "got", "USR1"] not in calls
    assert not any(c[:2] == ["scontrol", "requeue"] for c in calls)
    assert "SIGTERM: the ranks finish their step" in out
