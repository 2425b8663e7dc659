"""bench/gpu: the GPU check's dry run passes here and writes its report; its lists and its time boxes hold."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
GPU = ROOT / "bench" / "gpu"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    return env


def test_dry_run_passes_and_writes_json_and_markdown(tmp_path: Path) -> None:
    t = time.monotonic()
    r = subprocess.run(["bash", "bench/gpu/check.sh", "--dry-run", "--out", str(tmp_path / "out"),
                        "--work", str(tmp_path / "work")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert data["mode"] == "dry-run" and data["finished"]
    names = [s["name"] for s in data["steps"]]
    assert names[:4] == ["install", "env", "default_job", "gpu_tests"]
    assert {"train_step_100m", "weight_sync"} <= set(names)
    assert all(s["status"] == "dry-ok" for s in data["steps"]), data["steps"]
    job = next(s for s in data["steps"] if s["name"] == "default_job")["command"]
    assert "trainer.device=cuda" in job and "model.dtype=bfloat16" in job and "--nproc_per_node 1" in job
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    for name in names:
        assert f"| {name} | dry-ok |" in md
    print(f"dry run: {time.monotonic() - t:.1f} s")


def test_prepare_list_names_megatron_core_offline() -> None:
    r = subprocess.run(["bash", "bench/gpu/prepare.sh", "--list"], cwd=ROOT, env={**_env(), "PIP_NO_INDEX": "1"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pins = r.stdout.split()
    assert any(p.startswith("megatron-core==0.16.") for p in pins), pins
    assert all("==" in p for p in pins) and len({p.split("==")[0] for p in pins}) == len(pins)


def test_wheel_list_must_cover_setup_py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = _load("wheels")
    assert wheels.closure_errors()[1] == []
    names = [n for n in wheels.read_names(wheels.WHEELS_TXT) if n != "jsonschema"] + ["numpy-extra-thing"]
    short = tmp_path / "wheels.txt"
    short.write_text("\n".join(names) + "\n")
    monkeypatch.setattr(wheels, "WHEELS_TXT", short)
    errors = " | ".join(wheels.closure_errors()[1])
    assert "jsonschema (needed by setup.py) is neither in the GPU image" in errors
    assert "numpy-extra-thing is in wheels.txt but nothing in setup.py needs it" in errors


def test_wheel_folder_is_checked(tmp_path: Path) -> None:
    wheels = _load("wheels")
    for name in ("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "megatron_core-0.16.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "blake3-1.0.11-cp311-cp311-manylinux_2_17_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    errors = " | ".join(wheels.verify(tmp_path, ["megatron-core==0.16.1", "blake3==1.0.11", "omegaconf==2.3.1"]))
    assert "two wheels of megatron-core" in errors
    assert "blake3-1.0.11-cp311" in errors and "not installable by CPython 3.12" in errors
    assert "omegaconf==2.3.1: no wheel" in errors


def test_time_box_kills_the_step_and_its_detached_children(tmp_path: Path) -> None:
    check = _load("check")
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(60)\n")
    t = time.monotonic()
    status, rc = check.run_command([sys.executable, "-c", script], tmp_path / "log", 3.0, dict(os.environ))
    assert status == "timeout" and rc is None
    assert time.monotonic() - t < 30
    pid = int(pid_file.read_text())
    for _ in range(50):  # the grandchild (in a session of its own, like torchrun's workers) is gone too
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {pid} outlived the time box")


def test_dry_run_catches_a_rotten_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    check = _load("check")
    bad = [
        check.Step("bad_bench", "", 10, 1, lambda ctx: [ctx.python, "bench/weight_sync.py", "--no-such-flag"]),
        check.Step("bad_job", "", 10, 1, check.job_cmd("bad_job", ("trainer.total_trainig_steps=3",))),
    ]
    monkeypatch.setattr(check, "STEPS", [*check.STEPS, *bad])
    ctx = check.Ctx(out=tmp_path, work=tmp_path, python=sys.executable, device="cuda", dry=True)
    assert check.validate(["bad_bench", "bad_job"], ctx) == 1
    out = capsys.readouterr().out
    assert "DRY bad_bench fail SystemExit" in out
    assert "DRY bad_job fail" in out and "total_training_steps" in out  # the "did you mean" line
