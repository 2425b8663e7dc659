"""The prepared GPU check (bench/gpu/README.md): time-boxed steps, a JSON + markdown report rewritten after each.

    bash bench/gpu/check.sh                  # on the GPU machine: installs .whl/, runs every step, report in $OUT
    bash bench/gpu/check.sh --dry-run        # on CPU, in the suite: every step's command line checked
    bash bench/gpu/check.sh --only env,gpu_tests --budget 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SITE = "/tmp/site"
"""Where the carried wheels are installed on the GPU machine (first on PYTHONPATH)."""
TAIL_LINES = 40
LOG_CAP_BYTES = 2 * 2**20
"""Per step, at most this much of its log goes into the combined log in the output folder."""


@dataclass
class Ctx:
    out: Path
    work: Path
    python: str
    device: str  # "cuda" on the GPU machine; "cpu" to develop the driver here
    dry: bool


@dataclass
class Step:
    name: str
    what: str
    budget_s: int
    min_s: int
    command: Callable[[Ctx], list[str]]
    figures: Callable[[Ctx, str], dict[str, Any]] = lambda ctx, log: {}
    env: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- commands
def _wheels() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / ".whl").glob("*.whl"))


def install_cmd(ctx: Ctx) -> list[str]:
    return [ctx.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", SITE, *(_wheels() or [".whl/*.whl"])]


def env_cmd(ctx: Ctx) -> list[str]:
    return [ctx.python, str(HERE / "check.py"), "--facts", "--device", ctx.device]


def job_overrides(ctx: Ctx, name: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The default job (configs/default_tiny.yaml), shortened to a few steps, one process, bf16 on CUDA."""
    cuda = ctx.device == "cuda"
    return [
        f"trainer.device={ctx.device}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
        "trainer.total_training_steps=3", "trainer.sft_warmup_steps=10", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.logger=[console,jsonl]", "trainer.progress_bar=false",
        "trainer.plot_at_end=false", "trainer.rollout_data_dir=null", "trainer.resume_mode=disable",
        f"trainer.experiment_name=gpu_check_{name}", f"trainer.log_dir={ctx.work / name}",
        f"trainer.default_local_dir={ctx.work / name / 'ckpt'}", *extra,
    ]


OFFLOAD = ("actor.param_offload=true", "actor.grad_offload=true", "actor.optimizer_offload=true")


def job_cmd(name: str, extra: tuple[str, ...] = ()) -> Callable[[Ctx], list[str]]:
    def cmd(ctx: Ctx) -> list[str]:
        return [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                "launch/pretrain_rl.py", *job_overrides(ctx, name, extra)]

    return cmd


def gpu_test_files() -> list[str]:
    """Test files that hold GPU-marked tests (collecting only these keeps pytest's start short)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(errors="replace"))


def gpu_tests_cmd(ctx: Ctx) -> list[str]:
    return [ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "-o", "timeout=150",
            *gpu_test_files()]


def train_step_cmd(name: str, shape: tuple[str, ...] = (), attention: str = "both",
                   profile: bool = False) -> Callable[[Ctx], list[str]]:
    """``attention``: the local spec's fused kernels, the eager path, or both (the eager rows are the baseline);
    ``profile``: the bench also prints torch.profiler's top operators of one log-prob pass per row (in the log)."""

    def cmd(ctx: Ctx) -> list[str]:
        cuda = ctx.device == "cuda"
        sizes = (["--batch", "64", "--prompt", "128", "--response", "896", "--micro", "8", "--steps", "3"] if cuda
                 else ["--preset", "tiny", "--batch", "4", "--prompt", "16", "--response", "32", "--micro", "2",
                       "--steps", "1"])
        return [ctx.python, "bench/train_step.py", "--device", ctx.device, "--ranks", "1", "--layouts", "1",
                "--dtype", "bfloat16" if cuda else "float32", "--packing", "both", "--min-response-frac", "0.25",
                "--attention", attention, *(["--profile"] if profile else []), *sizes, *(shape if cuda else ()),
                "--json", str(ctx.work / f"{name}.json")]

    return cmd


def weight_sync_cmd(ctx: Ctx) -> list[str]:
    cuda = ctx.device == "cuda"
    shape = (["--hidden", "2048", "--layers", "24", "--heads", "16", "--kv-heads", "4", "--ffn", "5632",
              "--vocab", "32000", "--buckets", "64,256,1024", "--repeats", "3"] if cuda else
             ["--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "256", "--vocab", "4096",
              "--buckets", "1,4", "--repeats", "1"])
    return [ctx.python, "bench/weight_sync.py", "--device", ctx.device, "--ranks", "1",
            "--dtype", "bfloat16" if cuda else "float32", *shape, "--json", str(ctx.work / "weight_sync.json")]


# ---------------------------------------------------------------------------------------------------- figures
def install_figures(ctx: Ctx, log: str) -> dict[str, Any]:
    wheels = _wheels()
    return {"wheels": len(wheels), "wheel_mib": round(sum((ROOT / w).stat().st_size for w in wheels) / 2**20, 1)}


def env_figures(ctx: Ctx, log: str) -> dict[str, Any]:
    for line in log.splitlines():
        if line.startswith("FACTS "):
            return json.loads(line[len("FACTS "):])
    return {}


JOB_PREFIXES = ("timing_s/", "sharding/", "gpu/", "rollout/logprob_diff", "perf/", "critic/score/mean",
                "actor/grad_norm", "actor/pg_loss")


def job_figures(name: str) -> Callable[[Ctx, str], dict[str, Any]]:
    def figures(ctx: Ctx, log: str) -> dict[str, Any]:
        path = ctx.work / name / "metrics.jsonl"
        if not path.is_file():
            return {"error": f"no {path}"}
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        (ctx.out / f"{name}_metrics.jsonl").write_text(path.read_text())
        rl = [m for m in lines if any(k.startswith("rollout/") for k in m)]
        if not rl:
            return {"error": "metrics.jsonl has no RL step", "lines": len(lines)}
        last = rl[-1]
        out: dict[str, Any] = {"rl_steps": len(rl), "step": last.get("step")}
        out.update({k: round(v, 5) if isinstance(v, float) else v for k, v in sorted(last.items())
                    if k.startswith(JOB_PREFIXES)})
        diffs = [m["rollout/logprob_diff_max"] for m in rl if "rollout/logprob_diff_max" in m]
        if diffs:
            out["logprob_diff_max_over_steps"] = max(diffs)
        out["nvml_metrics"] = sum(k.startswith("gpu/") for k in last)
        if ctx.device == "cuda" and not out["nvml_metrics"]:
            out["warning"] = "no gpu/* metrics on CUDA (utils/gpu_metrics.py: NVML not found?)"
        return out

    return figures


def pytest_figures(ctx: Ctx, log: str) -> dict[str, Any]:
    last = next((x for x in reversed(log.splitlines()) if x.strip()), "")
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", last)
    out: dict[str, Any] = {k: int(n) for n, k in found}
    if ctx.device == "cuda" and not out.get("passed"):
        out["error"] = "no GPU-marked test passed on the GPU"
    return out


def json_figures(name: str, keys: tuple[str, ...]) -> Callable[[Ctx, str], dict[str, Any]]:
    def figures(ctx: Ctx, log: str) -> dict[str, Any]:
        path = ctx.work / f"{name}.json"
        if not path.is_file():
            return {"error": f"no {path.name}"}
        data = json.loads(path.read_text())
        head = {k: v for k, v in data.items() if k != "rows"}
        rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in keys}
                for r in data["rows"]]
        return {**head, "rows": rows}

    return figures


TRAIN_KEYS = ("packing", "attention", "tokens", "fwd_tok_s", "upd_tok_s", "fwd_mfu", "upd_mfu", "fwd_s", "upd_s", "peak_mem_gb",
              "params_per_rank")
SYNC_KEYS = ("bucket_mb", "buckets", "seconds", "raw", "export_gb_s", "raw_gb_s", "export_over_raw", "peak", "bound")

def long_row_cmd(ctx: Ctx) -> list[str]:
    """A Qwen2.5-1.5B-shaped body on one 8k-token row: the device's peak over a log-prob pass and an update, whole
    vs chunked logits, with and without recomputation, the planner's figures beside (toy sizes on CPU)."""
    cuda = ctx.device == "cuda"
    sizes = (["--hidden", "1536", "--layers", "28", "--heads", "12", "--kv-heads", "2", "--ffn", "8960",
              "--vocab", "151936", "--tokens", "8192", "--dtype", "bfloat16",
              "--variants", "whole,chunked,chunked+recompute,chunked+selective,chunked+recompute+host-adam"] if cuda else
             ["--tokens", "1024", "--vocab", "4096", "--variants", "whole,chunked,chunked+recompute"])
    return [ctx.python, "bench/long_row_memory.py", "--device", ctx.device, *sizes,
            "--json", str(ctx.work / "long_row_memory.json")]


LONG_ROW_KEYS = ("variant", "peak_gb", "before_gb", "log_prob_gb", "plan_log_prob_gb", "update_gb",
                 "plan_update_peak_gb", "tokens_per_s", "log_prob_s", "update_s", "chunk_tokens", "plan_saved_gb",
                 "grad_norm")

QWEN3_06B_BODY = ("--hidden", "1024", "--layers", "28", "--heads", "16", "--kv-heads", "8", "--ffn", "3072")

STEPS: list[Step] = [
    Step("install", "the carried wheels install into /tmp/site (megatron-core, hydra, ...)", 90, 15, install_cmd,
         install_figures),
    Step("env", "GPU, driver, torch/CUDA/megatron-core versions, nvidia-smi, the per-engine install matrix", 90, 15,
         env_cmd, env_figures),
    Step("default_job", "the default job on one GPU (NCCL world of 1, bf16, transformers engine): SFT, RL steps, "
         "weight sync, engine-vs-trainer log-prob gap, NVML per phase", 180, 60, job_cmd("default_job"),
         job_figures("default_job")),
    Step("gpu_tests", "pytest -m gpu (the GPU-marked tests)", 150, 30, gpu_tests_cmd, pytest_figures),
    Step("memory_at_size", "a 1.5B-shaped body (Qwen2.5-1.5B, 152k vocab, bf16) on one 8k-token row: the device's "
         "peak and time of a log-prob pass and an update with the whole logits, chunked logits, and chunked with "
         "full or selective recomputation; the planner's saved and update-peak figures beside", 240, 120,
         long_row_cmd, json_figures("long_row_memory", LONG_ROW_KEYS)),
    Step("train_step_100m", "actor log-prob and update throughput and MFU, 100m preset, packed vs padded, the "
         "local spec's fused attention vs its eager path", 150, 60, train_step_cmd("train_step_100m"), json_figures("train_step_100m", TRAIN_KEYS)),
    Step("weight_sync", "weight-sync export of a 1.3B model on CUDA: GB/s vs a raw copy of the same bytes", 120, 40,
         weight_sync_cmd, json_figures("weight_sync", SYNC_KEYS)),
    Step("train_step_0p5b", "actor throughput and MFU, a Qwen3-0.6B-shaped body (16k vocab), packed vs padded, "
         "fused attention; torch.profiler's top operators of one log-prob pass each (in the log)", 180, 60,
         train_step_cmd("train_step_0p5b", QWEN3_06B_BODY, "fused", profile=True), json_figures("train_step_0p5b", TRAIN_KEYS)),
    Step("offload_job", "the default job with actor param/grad/optimizer offload: gpu/freed_gb/* and sharding "
         "offload metrics", 150, 60, job_cmd("offload_job", OFFLOAD), job_figures("offload_job")),
]


# ---------------------------------------------------------------------------------------------------- running
def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the step's process group (torchrun forwards it), then SIGKILL it and every descendant by pid.

    torchrun starts its workers in sessions of their own: they are found through /proc before the signal,
    since they are re-parented once torchrun is gone."""
    family = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *family, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run_command(argv: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> tuple[str, int | None]:
    """Run ``argv`` in the repo root with its output in ``log_path``; (pass|fail|timeout, exit code)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return "timeout", None
    return ("pass" if rc == 0 else "fail"), rc


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so a step's strays stay findable."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def kill_strays() -> int:
    """SIGKILL and reap what a finished step left running under this (subreaper) process; how many there were."""
    strays = _descendants(os.getpid())
    for pid in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for _ in range(len(strays) * 2 + 1):
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    return len(strays)


def step_env(ctx: Ctx) -> dict[str, str]:
    env = dict(os.environ)
    paths = [SITE, str(ROOT)] if ctx.device == "cuda" else [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("OMP_NUM_THREADS", "4" if ctx.device == "cuda" else "1")
    return env


def tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-n:])


# ---------------------------------------------------------------------------------------------------- report
class Report:
    """gpu_check.json and gpu_check.md, rewritten (atomically) after every change so a kill leaves the last state."""

    def __init__(self, ctx: Ctx, steps: list[Step], budget_s: float) -> None:
        self.ctx = ctx
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {
            "schema": 1, "mode": "dry-run" if ctx.dry else ctx.device,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "budget_s": budget_s, "elapsed_s": 0.0, "finished": False,
            "steps": [{"name": s.name, "what": s.what, "status": "pending", "seconds": None, "budget_s": s.budget_s,
                       "command": shlex.join(s.command(ctx)), "figures": {}, "log_tail": ""} for s in steps],
        }
        self.write()

    def step(self, name: str) -> dict[str, Any]:
        return next(s for s in self.data["steps"] if s["name"] == name)

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        counts: dict[str, int] = {}
        for s in self.data["steps"]:
            counts[s["status"]] = counts.get(s["status"], 0) + 1
        self.data["summary"] = counts
        for path, text in ((self.ctx.out / "gpu_check.json", json.dumps(self.data, indent=1, default=str)),
                           (self.ctx.out / "gpu_check.md", self.markdown())):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def markdown(self) -> str:
        d = self.data
        facts = next((s["figures"] for s in d["steps"] if s["name"] == "env" and s["figures"]), {})
        lines = [f"# GPU check ({d['mode']}), {d['started']}", ""]
        if facts:
            lines += [f"{facts.get('gpu', '?')}, driver {facts.get('driver', '?')}, torch {facts.get('torch', '?')} "
                      f"(CUDA {facts.get('cuda', '?')}), megatron-core {facts.get('megatron_core', '?')}, "
                      f"transformers {facts.get('transformers', '?')}, Python {facts.get('python', '?')}", ""]
        summary = ", ".join(f"{n} {k}" for k, n in sorted(d["summary"].items()))
        lines += [f"{summary}; {d['elapsed_s']} s of {d['budget_s']} s"
                  + ("" if d["finished"] else " (not finished: the run was cut off or is still going)"), "",
                  "| step | status | seconds | key figures |", "| --- | --- | --- | --- |"]
        for s in d["steps"]:
            lines.append(f"| {s['name']} | {s['status']} | {s['seconds'] if s['seconds'] is not None else ''} | "
                         f"{_brief(s['figures'])} |")
        for s in d["steps"]:
            if s["status"] == "pending":
                continue
            lines += ["", f"## {s['name']}: {s['status']}", "", s["what"], "", f"`{s['command']}`", ""]
            if s["figures"]:
                lines += ["```json", json.dumps(s["figures"], indent=1, default=str), "```", ""]
            if s["log_tail"]:
                lines += ["<details><summary>log tail</summary>", "", "```", s["log_tail"], "```", "</details>"]
        return "\n".join(lines) + "\n"


BRIEF = ("reason", "error", "warning", "exit_code", "gpu", "driver", "torch", "megatron_core", "wheels", "wheel_mib", "passed",
         "failed", "skipped", "errors", "rl_steps", "logprob_diff_max_over_steps", "rollout/logprob_diff_mean",
         "timing_s/step", "timing_s/sharding/sync", "nvml_metrics", "gpu/freed_gb/actor_offload",
         "gpu/freed_gb/engine_release", "check")
"""The figures a table cell shows, when a step has them."""


def _brief(figures: dict[str, Any], limit: int = 7) -> str:
    """A table cell: the key figures (rows of a bench: each row's throughput and MFU)."""
    if "rows" in figures:
        parts = []
        for r in figures["rows"]:
            label = (" ".join(str(r[k]) for k in ("packing", "attention") if r.get(k))
                     or f"{r.get('bucket_mb')} MiB")
            vals = [f"{k}={r[k]:.3g}" for k in ("fwd_tok_s", "upd_tok_s", "fwd_mfu", "upd_mfu", "peak_mem_gb",
                                                 "export_gb_s", "raw_gb_s") if isinstance(r.get(k), (int, float))]
            parts.append(f"{label}: {' '.join(vals)}")
        return "; ".join(parts)
    items = [(k, figures[k]) for k in BRIEF if isinstance(figures.get(k), (int, float, str))] or [
        (k, v) for k, v in figures.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items[:limit])
    return text.replace("|", "/")


# ---------------------------------------------------------------------------------------------------- facts
def facts() -> dict[str, Any]:
    """Environment facts (run as a step's child: imports torch and megatron)."""
    import platform

    out: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        out.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out.update(gpu=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                       gpu_memory_gb=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                       nccl=".".join(map(str, torch.cuda.nccl.version())), bf16=torch.cuda.is_bf16_supported())
    except Exception as exc:  # noqa: BLE001 -- facts are best effort, each on its own
        out["torch_error"] = repr(exc)
    for key, dist in (("megatron_core", "megatron-core"), ("transformers", "transformers"),
                      ("nvidia_ml_py", "nvidia-ml-py"), ("packaging", "packaging")):
        try:
            import importlib.metadata as md

            out[key] = md.version(dist)
        except Exception:  # noqa: BLE001
            out[key] = None
    try:
        import pynvml

        pynvml.nvmlInit()
        out["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # noqa: BLE001
        out["driver"] = f"unknown ({type(exc).__name__})"
    return out


def print_facts(device: str) -> int:
    """The env step: facts as one ``FACTS {json}`` line, nvidia-smi, the install matrix; 1 when CUDA is asked for
    and torch sees none."""
    f = facts()
    print("FACTS " + json.dumps(f), flush=True)
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        print(smi.stdout + smi.stderr, flush=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"nvidia-smi: {exc}", flush=True)
    sys.path.insert(0, str(HERE))
    import smoke_import

    smoke_import.main(["--report"])
    return 0 if f.get("cuda_available") or device == "cpu" else 1


# ---------------------------------------------------------------------------------------------------- dry run
def validate(names: list[str], ctx: Ctx) -> int:
    """In a child process: check that each named step's command line is valid here, without a GPU.

    Prints ``DRY <name> ok|fail <message>`` per step; 0 when all are ok."""
    sys.path[:0] = [str(ROOT), str(HERE)]
    bad = 0
    for name in names:
        step = next(s for s in STEPS if s.name == name)
        try:
            msg = _validate_one(step, ctx) or "ok"
            print(f"DRY {name} ok {msg}", flush=True)
        except BaseException as exc:  # noqa: BLE001 -- SystemExit from argparse included
            bad += 1
            print(f"DRY {name} fail {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
    return 1 if bad else 0


def _validate_one(step: Step, ctx: Ctx) -> str:
    import importlib.util

    argv = step.command(ctx)
    if step.name == "install":
        import wheels

        _, errors = wheels.closure_errors()
        if errors:
            raise ValueError("; ".join(errors))
        msg = f"{len(wheels.read_names(wheels.WHEELS_TXT))} wheels cover setup.py"
        if (ROOT / ".whl").is_dir():
            errors = wheels.verify(ROOT / ".whl", wheels.pins())
            if errors:
                raise ValueError("; ".join(errors))
            msg += f"; .whl/ holds them ({len(_wheels())} files)"
        else:
            msg += "; no .whl/ here (run bench/gpu/prepare.sh before a GPU window)"
        return msg
    if step.name == "env":
        import smoke_import

        smoke_import._args(["--report"])
        missing = [m for m, _ in smoke_import.ENGINES["hf"] if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"the hf engine's modules are not importable here: {missing}")
        return f"smoke_import parses; the hf engine's {len(smoke_import.ENGINES['hf'])} modules are found here"
    if argv[1:4] == ["-m", "torch.distributed.run", "--standalone"]:
        from mcore_agentic.config import check_overrides, compose, load_config

        script = argv.index("launch/pretrain_rl.py")
        overrides = argv[script + 1:]
        check_overrides(overrides)
        cfg = load_config(compose("default_tiny", overrides))
        from mcore_agentic.config.paths import search_dirs
        from mcore_agentic.trainer.preflight import preflight
        from mcore_agentic.utils.errors import raise_errors

        # The launcher's pre-flight for a world of one, but for the device: the dry run is on a CPU machine.
        raise_errors([p for p in preflight(cfg, 1, dirs=search_dirs()) if p.field != "trainer.device"])
        return f"{len(overrides)} overrides compose and validate (world 1, device {cfg.trainer.device}, {cfg.model.dtype})"
    if step.name == "gpu_tests":
        files = gpu_test_files()
        if not files:
            raise ValueError("no test file holds pytest.mark.gpu")
        if '"gpu:' not in (ROOT / "pyproject.toml").read_text():
            raise ValueError("pyproject.toml does not register the gpu marker")
        for f in files:
            compile((ROOT / f).read_text(), f, "exec")
        return f"{len(files)} file(s): {', '.join(files)}"
    if argv[1].startswith("bench/"):
        path = ROOT / argv[1]
        spec = importlib.util.spec_from_file_location(f"_dry_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        a = module._args(argv[2:])
        return f"{argv[1]} accepts its arguments (device {a.device}, {a.dtype})"
    raise ValueError(f"no dry-run check for step {step.name}")


# ---------------------------------------------------------------------------------------------------- main
def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="check every step's command line on this machine (CPU)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "outputs" / "gpu_check"),
                   help="report folder (default: $OUT, else outputs/gpu_check)")
    p.add_argument("--work", default="/tmp/gpu_check", help="scratch folder for runs, models and step logs")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together")
    p.add_argument("--only", default="", help=f"comma-separated steps (default all: {','.join(s.name for s in STEPS)})")
    p.add_argument("--python", default=sys.executable, help="the interpreter every step runs")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu runs the steps here on CPU at toy sizes (to develop this driver; slow)")
    p.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--validate", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    names = [s.name for s in STEPS]
    unknown = [n for n in a.only.split(",") if n and n not in names]
    if unknown:
        p.error(f"unknown step(s) {unknown}; steps: {', '.join(names)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.facts:
        return print_facts(a.device)
    out, work = Path(a.out), Path(a.work)
    ctx = Ctx(out=out, work=work, python=a.python, device=a.device, dry=a.dry_run)
    if a.validate:
        return validate(a.validate.split(","), ctx)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    steps = [s for s in STEPS if not a.only or s.name in a.only.split(",")]
    report = Report(ctx, steps, a.budget)
    if a.dry_run:
        return dry_run(ctx, steps, report)
    deadline = time.monotonic() + a.budget
    become_subreaper()
    combined = out / "gpu_check.log"
    combined.write_text("")
    env = step_env(ctx)
    for step in steps:
        rec = report.step(step.name)
        left = deadline - time.monotonic()
        if left < step.min_s:
            rec.update(status="skipped", figures={"reason": f"{left:.0f} s left, needs {step.min_s} s"})
            report.write()
            continue
        if step.name == "install" and (ctx.device == "cpu" or not _wheels()):
            reason = ("the wheels are for the GPU machine's Python 3.12; here the venv has what they carry"
                      if ctx.device == "cpu" else "no .whl/*.whl: run bench/gpu/prepare.sh and carry .whl")
            rec.update(status="skipped" if ctx.device == "cpu" else "fail", figures={"reason": reason})
            report.write()
            continue
        shutil.rmtree(work / step.name, ignore_errors=True)  # no stale figures from an earlier run on this machine
        (work / f"{step.name}.json").unlink(missing_ok=True)
        timeout = min(step.budget_s, left)
        rec.update(status="running", command=shlex.join(step.command(ctx)))
        report.write()
        print(f"[gpu_check] {step.name}: up to {timeout:.0f} s", flush=True)
        log_path = work / f"{step.name}.log"
        t = time.monotonic()
        status, rc = run_command(step.command(ctx), log_path, timeout, {**env, **step.env})
        seconds = round(time.monotonic() - t, 1)
        strays = kill_strays()  # e.g. torchrun workers outliving their launcher would hold the GPU
        log = log_path.read_text(errors="replace")
        try:
            figures = step.figures(ctx, log)
        except Exception as exc:  # noqa: BLE001 -- a figure parser must not end the check
            figures = {"error": f"figures: {type(exc).__name__}: {exc}"}
        if status == "pass" and "error" in figures:
            status = "fail"
        figures = {**({"exit_code": rc} if rc else {}), **({"strays_killed": strays} if strays else {}), **figures}
        rec.update(status=status, seconds=seconds, figures=figures, log_tail=tail(log))
        report.write()
        with open(combined, "a") as f:
            data = log.encode()[-LOG_CAP_BYTES:].decode(errors="replace")
            f.write(f"\n===== {step.name}: {status} in {seconds} s =====\n{data}\n")
        print(f"[gpu_check] {step.name}: {status} in {seconds} s {_brief(figures)}", flush=True)
    report.data["finished"] = True
    report.write()
    print((out / "gpu_check.md").read_text(), flush=True)
    return 0 if all(s["status"] in ("pass", "skipped") for s in report.data["steps"]) else 1


def dry_run(ctx: Ctx, steps: list[Step], report: Report) -> int:
    """Validate every step in one child process (torch imported once), through the same runner as a real run."""
    t = time.monotonic()
    log_path = ctx.work / "dry_run.log"
    argv = [ctx.python, str(HERE / "check.py"), "--validate", ",".join(s.name for s in steps), "--work", str(ctx.work)]
    status, rc = run_command(argv, log_path, 120, step_env(ctx))
    log = log_path.read_text(errors="replace")
    results = {m[0]: (m[1], m[2]) for m in re.findall(r"^DRY (\S+) (ok|fail) (.*)$", log, re.M)}
    for step in steps:
        rec = report.step(step.name)
        ok, msg = results.get(step.name, ("fail", f"no result (validator {status}, exit {rc})"))
        rec.update(status="dry-ok" if ok == "ok" else "dry-fail", seconds=0.0, figures={"check": msg},
                   log_tail="" if ok == "ok" else tail(log))
    report.data["finished"] = True
    report.data["dry_run_s"] = round(time.monotonic() - t, 1)
    report.write()
    # the report must read back: valid JSON, a markdown row per step
    data = json.loads((ctx.out / "gpu_check.json").read_text())
    md = (ctx.out / "gpu_check.md").read_text()
    missing = [s.name for s in steps if f"| {s.name} |" not in md]
    ok = all(s["status"] == "dry-ok" for s in data["steps"]) and not missing
    for s in data["steps"]:
        print(f"{s['name']:<16} {s['status']:<9} {s['figures'].get('check', '')}")
    if missing:
        print(f"gpu_check.md lacks rows for {missing}")
    print(f"dry run {'passed' if ok else 'FAILED'} in {time.monotonic() - t:.1f} s; report in {ctx.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
