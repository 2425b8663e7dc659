"""``PythonCodeTool``: run the model's Python in a limited, network-less subprocess and report what happened.

Each call gets a fresh temporary directory (deleted afterwards) holding an
empty working directory; the child is ``python -I`` (no ``PYTHON*``
variables, no user site, neither the script's nor the current directory on
``sys.path``) with a minimal environment (``PATH``, locale, ``HOME``/``TMPDIR`` =
its working directory, single-threaded BLAS) so no secret of the trainer's
environment leaks in. :mod:`mcore_agentic.tools.sandbox_child` then limits
itself and isolates the network before running the code.

Guarantees, honestly:

* kernel-enforced: wall-clock timeout (the whole process group is killed),
  CPU seconds, address space, file size (stdout/stderr go to files, so output
  is bounded too), open files, no core dumps; no network when the kernel allows
  an unprivileged network namespace (``metrics["network_namespace"] == 1``);
  ``RLIMIT_NPROC`` stops new processes/threads for non-root users only;
* best effort (a PEP 578 audit hook, which determined code can evade): no
  sockets, no subprocesses or signals, no ctypes, no file access outside the
  working directory except reading the interpreter's own libraries.

Use a container or VM sandbox for untrusted models at scale; this is the
embedded default.

``site_packages: true`` (default) lets the code import installed packages
(numpy, sympy, ...); ``false`` runs ``python -S`` with the standard library only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_agentic.config.load import build
from mcore_agentic.tools.base import BaseTool, ToolResponse, error_response

CHILD_SCRIPT = str(Path(__file__).with_name("sandbox_child.py"))
_FENCE = re.compile(r"^\s*```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run; the tool's YAML ``config:`` fills these."""

    timeout_s: float = 10.0
    """Wall-clock limit; the process group is killed after it."""
    cpu_time_s: int = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS); importing numpy needs a few hundred MB."""
    max_file_mb: float = 16.0
    """Largest file the code may write (RLIMIT_FSIZE), stdout/stderr included."""
    max_open_files: int = 256
    max_processes: int = 0
    """RLIMIT_NPROC: 0 forbids new processes and threads (the kernel ignores it for root)."""
    max_output_chars: int = 4000
    """stdout and stderr are each cut to this many characters (head and tail kept) in the observation."""
    site_packages: bool = True
    network_namespace: bool = True
    """Try ``unshare(CLONE_NEWNET)`` for a network-less child."""
    extra_read_paths: tuple[str, ...] = ()
    """More directories the code may read (e.g. a data folder)."""

    def __post_init__(self) -> None:
        from mcore_agentic.config.errors import require

        require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        require(self.cpu_time_s >= 1, "cpu_time_s", f"must be >= 1, got {self.cpu_time_s}")
        require(self.memory_mb >= 64, "memory_mb", f"must be >= 64 (the interpreter alone needs ~30 MB), got {self.memory_mb}")
        require(self.max_file_mb > 0, "max_file_mb", f"must be > 0, got {self.max_file_mb}")
        require(self.max_open_files >= 16, "max_open_files", f"must be >= 16, got {self.max_open_files}")
        require(self.max_processes >= 0, "max_processes", f"must be >= 0, got {self.max_processes}")
        require(self.max_output_chars >= 100, "max_output_chars", f"must be >= 100, got {self.max_output_chars}")


@dataclass
class ExecutionResult:
    """What one run did (picklable: it crosses process/Ray boundaries)."""

    stdout: str
    stderr: str
    exit_code: int | None
    """None when killed by a signal or timeout."""
    signal_name: str | None
    timed_out: bool
    duration_s: float
    stdout_truncated: bool
    stderr_truncated: bool
    network: str
    """'namespace' (kernel-isolated) or 'audit-hook' (best effort), '' if the child never got that far."""


def _minimal_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        # One thread per BLAS/OpenMP runtime: threads would count against RLIMIT_NPROC and the address space.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    """The file's text cut to ``limit`` characters, keeping its head and its tail (where tracebacks end)."""
    size = path.stat().st_size
    window = 4 * limit  # utf-8 is at most 4 bytes a character, so a window always holds >= limit characters
    with open(path, "rb") as f:
        if size <= 2 * window:
            head = tail = f.read().decode("utf-8", errors="replace")
        else:
            head = f.read(window).decode("utf-8", errors="replace")
            f.seek(size - window)
            tail = f.read().decode("utf-8", errors="replace")
    if head is tail and len(head) <= limit:
        return head, False
    half = limit // 2
    return f"{head[:half]}\n...[output truncated]...\n{tail[-half:]}", True


def run_sandboxed(code: str, limits: SandboxLimits) -> ExecutionResult:
    """Blocking: run ``code`` under ``limits`` and collect its output. Never raises for the code's behaviour."""
    root = Path(tempfile.mkdtemp(prefix="mcore_agentic_code_"))
    try:
        workdir = root / "work"
        workdir.mkdir()
        code_path, status_path = root / "main.py", root / "status.json"
        code_path.write_text(code, encoding="utf-8")
        settings = {
            "code_path": str(code_path),
            "status_path": str(status_path),
            "cpu_time_s": limits.cpu_time_s,
            "memory_mb": limits.memory_mb,
            "max_file_mb": limits.max_file_mb,
            "max_open_files": limits.max_open_files,
            "max_processes": limits.max_processes,
            "network_namespace": limits.network_namespace,
            "extra_read_paths": list(limits.extra_read_paths),
        }
        cmd = [sys.executable, "-I", "-B", "-X", "utf8"]
        if not limits.site_packages:
            cmd.append("-S")
        cmd += [CHILD_SCRIPT, json.dumps(settings)]
        out_path, err_path = root / "stdout", root / "stderr"
        timed_out = False
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd,
                cwd=workdir,
                env=_minimal_env(str(workdir)),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                close_fds=True,
                start_new_session=True,  # its own process group, killed as a whole below
            )
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # also reaps anything it left running
                except ProcessLookupError:
                    pass
                proc.wait()
        duration = time.monotonic() - start
        stdout, out_cut = _read_capped(out_path, limits.max_output_chars)
        stderr, err_cut = _read_capped(err_path, limits.max_output_chars)
        try:
            network = json.loads(status_path.read_text())["network"]
        except (OSError, ValueError, KeyError):
            network = ""
        rc = proc.returncode
        sig = signal.Signals(-rc).name if rc is not None and rc < 0 and not timed_out else None
        return ExecutionResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=None if timed_out or (rc is not None and rc < 0) else rc,
            signal_name=sig,
            timed_out=timed_out,
            duration_s=duration,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            network=network,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


_SIGNAL_HINTS = {
    "SIGXCPU": "CPU time limit exceeded",
    "SIGKILL": "killed (CPU time or memory limit)",
    "SIGXFSZ": "output/file size limit exceeded",
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "aborted",
}


def format_observation(result: ExecutionResult, limits: SandboxLimits) -> str:
    """The text the model reads: its output, then what went wrong, if anything."""
    parts: list[str] = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"Error: execution timed out after {limits.timeout_s:g} s and was stopped.")
    elif result.signal_name is not None:
        hint = _SIGNAL_HINTS.get(result.signal_name, "terminated by a signal")
        parts.append(f"Error: the process was killed by {result.signal_name} ({hint}).")
    elif result.exit_code not in (0, None):
        parts.append(f"(exit code {result.exit_code})")
    if not parts:
        parts.append("(no output; use print() to show results)")
    return "\n".join(parts)


def strip_code_fence(code: str) -> str:
    """Models often wrap code in a markdown fence; run what is inside."""
    match = _FENCE.match(code)
    return match.group(1) if match else code


class PythonCodeTool(BaseTool):
    """Run Python code; parameters ``{"code": str}``. Output, errors and timeouts come back as the observation.

    Execution goes through ``self.executor`` (the rollout's local pool or
    Ray), so the event loop keeps serving other requests meanwhile.
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        super().__init__(config, tool_schema)
        self.limits: SandboxLimits = build(SandboxLimits, self.config, path="config")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str) or not code.strip():
            return error_response(f"Error: tool '{self.name}' needs a non-empty string argument 'code'.", bad_call=1)
        code = strip_code_fence(code)
        try:
            # The child is killed after timeout_s; the extra margin only covers start-up and clean-up.
            result = await self.run_blocking(run_sandboxed, code, self.limits, timeout=self.limits.timeout_s + 30.0)
        except TimeoutError:
            return error_response(f"Error: execution timed out after {self.limits.timeout_s:g} s and was stopped.", timeout=1)
        except Exception as exc:  # noqa: BLE001 -- e.g. the interpreter could not start: still an observation
            return error_response(f"Error: could not run the code: {type(exc).__name__}: {exc}", exception=1)
        failed = result.timed_out or result.signal_name is not None or result.exit_code != 0
        metrics = {
            "exit_code": -1 if result.exit_code is None else result.exit_code,
            "timed_out": int(result.timed_out),
            "duration_s": result.duration_s,
            "network_namespace": int(result.network == "namespace"),
        }
        return ToolResponse(text=format_observation(result, self.limits), metrics=metrics, is_error=failed)
