"""Run model-written Python in a sandbox and report what it did: ``Sandbox.run(code) -> ExecutionResult``.

Isolation (``sandbox`` in the code tool's config):

* ``bwrap`` (default): a bubblewrap sandbox per execution (see :mod:`.bwrap` for what it
  mounts and unshares), as an unprivileged host uid whatever the trainer's (:mod:`.host_user`),
  with a seccomp filter (:mod:`.seccomp`) and, where the host has one, a memory cgroup
  (:mod:`.memory_cgroup`). Building a :class:`Sandbox` runs one execution through exactly that
  path; if it fails (no working ``bwrap``, no spare uid for a root trainer, ...) it raises
  :class:`~mcore_agentic.utils.errors.ConfigError` with the cause and the fix;
* ``unsafe_subprocess``: a plain subprocess with the same limits but no
  isolation (the audit hook is all that stands between the code and the host).
  Only when a config says so explicitly; logged as a warning once per process.

Inside either, :mod:`.sandbox_child` sets the resource limits (CPU seconds,
address space, file size, open files, processes) and an audit hook as inner
layers, then runs the code.

A *worker* (:mod:`.sandbox_worker`) is one sandbox started ahead of its execution: it boots the
interpreter and waits for code on stdin. It serves exactly one execution and is then killed
with everything it started, so when :meth:`Sandbox.run` returns no process of that execution
is left. ``warm_pool`` workers are kept started so an execution does not wait for the
interpreter to boot; no worker is ever reused, so no state crosses executions or trajectories.

Host-side state and its clean-up: in ``bwrap`` mode an execution's only state outside the
kernel's namespaces is its cgroup directory; in ``unsafe_subprocess`` mode, its working
directory. Both live under a name carrying the owner's pid and start time
(:mod:`.owner`) and are removed when the execution ends, by :meth:`Sandbox.close` (at exit, also
after a stop signal), and, for a trainer that was killed before either could run, by the next
:class:`Sandbox` on the host. If the trainer dies, ``--die-with-parent`` kills its sandboxes.

The wall-clock ``timeout_s`` counts from the moment the code is handed to its
worker, never the wait for an executor slot.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from mcore_agentic.tools.bwrap import (
    BOOTSTRAP_PATH,
    FIX_USERNS,
    SANDBOX_UID,
    WORKDIR,
    SandboxUnavailable,
    bootstrap_source,
    bwrap_argv,
    describe_failure,
    find_bwrap,
    interpreter_image,
)
from mcore_agentic.tools.host_user import HostUser, HostUserError, resolve_host_user
from mcore_agentic.tools.memory_cgroup import MemoryCgroups
from mcore_agentic.tools.owner import OwnerTag, stale_entries
from mcore_agentic.tools.sandbox_child import DROP_FAILED
from mcore_agentic.tools.sandbox_limits import ExecutionResult, SandboxLimits
from mcore_agentic.tools.sandbox_worker import SpawnPlan, Worker
from mcore_agentic.tools.seccomp import build_filter
from mcore_agentic.utils.errors import ConfigError

logger = logging.getLogger(__name__)

_MB = 1024 * 1024
_STATE_PREFIX = "mcore_agentic_sandbox"


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


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


class Sandbox:
    """Runs code under one :class:`SandboxLimits`; thread-safe; see the module docstring."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self._idle: collections.deque[Worker] = collections.deque()
        self._busy: set[Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._cgroups: MemoryCgroups | None = None
        self.memory_bound = "none (unsafe_subprocess)"
        """How the execution's RAM is bounded: a memory cgroup, or the address-space limit with the other routes denied."""
        self._host_user: HostUser | None = None
        self._state_dir: Path | None = None
        if limits.sandbox == "bwrap":
            try:
                self._bwrap = find_bwrap(limits.bwrap_path)
                self._host_user = resolve_host_user(limits.host_user, limits.host_uid_range)
                self._image = interpreter_image(limits.site_packages, limits.extra_read_paths)
                self._use_memory_cgroup()
                self._seccomp = build_filter(allow_processes=limits.max_processes > 0, deny_unbounded_ram=self._cgroups is None)
                if self._seccomp is None:
                    raise SandboxUnavailable(
                        "the sandbox's seccomp filter is described for x86-64 and aarch64 only; run on one of them, "
                        "or set sandbox: unsafe_subprocess to run model code without isolation"
                    )
                self._probe()
            except (SandboxUnavailable, HostUserError) as exc:
                self.close()
                raise ConfigError("sandbox", str(exc)) from None
            if self._host_user.drops_root:
                for path in limits.extra_read_paths:
                    mode = os.stat(path).st_mode
                    need = 0o005 if os.path.isdir(path) else 0o004
                    if mode & need != need:
                        logger.warning(
                            "code tool: extra_read_paths %r is not readable by others (mode %o), so the sandbox's "
                            "unprivileged uid cannot read it; chmod o+rX it if the code should",
                            path,
                            mode & 0o777,
                        )
            if self._host_user.is_host_root:
                _warn_once(
                    "host-root",
                    "code tool: host_user: trainer runs model-written code as the trainer's uid, which is host root: "
                    "the kernel then exempts it from per-user limits and root-only files in extra_read_paths are "
                    "readable; use host_user: auto (a dedicated unprivileged uid per execution)",
                )
        else:
            self._state_dir = _process_state_dir()
            _warn_once(
                "unsafe",
                "code tool: sandbox: unsafe_subprocess runs model-written code WITHOUT isolation (same user, "
                "host filesystem and processes visible; only resource limits and an audit hook); use sandbox: bwrap",
            )
        # Warm workers are started by one long-lived thread: a sandbox dies with the thread that started it
        # (--die-with-parent), and the caller of run() goes straight to its own code's output.
        self._refill_wanted = threading.Event()
        self._refill_wanted.set()
        threading.Thread(target=self._refill_loop, name="sandbox-refill", daemon=True).start()

    @property
    def has_memory_cgroup(self) -> bool:
        """Whether each execution gets a memory cgroup (else memfd and System V IPC are denied)."""
        return self._cgroups is not None

    def _use_memory_cgroup(self) -> None:
        if self.limits.memory_cgroup == "off":
            self.memory_bound = "address-space limit; memfd and System V IPC denied (memory_cgroup: off)"
            return
        self._cgroups, where = _process_cgroups()
        if self._cgroups is not None:
            self.memory_bound = where
        elif self.limits.memory_cgroup == "required":
            raise SandboxUnavailable(
                f"memory_cgroup: required, but no memory cgroup can be created here ({where}); run the trainer as root "
                "on a host with cgroups, delegate a cgroup v2 subtree to its user, or set memory_cgroup: auto"
            )
        else:
            self.memory_bound = f"address-space limit; memfd and System V IPC denied (no memory cgroup: {where})"
            logger.info("code tool: no memory cgroup for the sandbox (%s); memfd and System V IPC are denied", where)

    def _probe(self) -> None:
        """One execution through the real path: proves bwrap, the maps, the privilege drop and the cgroup work here."""
        marker = "sandbox-probe-ok"
        try:
            result = self._execute(self._spawn(), f"import os\nprint({marker!r}, os.getuid())")
        except (OSError, RuntimeError) as exc:
            raise SandboxUnavailable(f"could not set up the sandbox ({type(exc).__name__}: {exc}); {FIX_USERNS}") from None
        if result.exit_code == DROP_FAILED:
            raise SandboxUnavailable(f"the sandbox did not start unprivileged ({result.stderr.strip()})")
        if result.stdout.split() != [marker, str(SANDBOX_UID)]:
            raise SandboxUnavailable(describe_failure(result.stderr, result.exit_code))

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

    def _command(self, script: str) -> list[str]:
        limits = self.limits
        settings = {
            "cpu_time_s": limits.cpu_time_s,
            "memory_mb": limits.memory_mb,
            "max_file_mb": limits.max_file_mb,
            "max_open_files": limits.max_open_files,
            "max_processes": limits.max_processes,
            "isolate_network": limits.sandbox == "unsafe_subprocess",
            "extra_read_paths": list(limits.extra_read_paths),
            "expect_uid": SANDBOX_UID if limits.sandbox == "bwrap" else None,
            "expect_no_groups": self._host_user is not None and self._host_user.drops_root,
        }
        args = [sys.executable, "-I", "-B", "-X", "utf8"]
        if not limits.site_packages:
            args.append("-S")
        return [*args, script, json.dumps(settings)]

    def _spawn(self) -> Worker:
        n = next(_worker_numbers)
        if self.limits.sandbox != "bwrap":
            assert self._state_dir is not None
            workdir = self._state_dir / f"w{n}"
            workdir.mkdir()
            plan = SpawnPlan(self._command(bootstrap_source()), self._env(str(workdir)), str(workdir), workdir=workdir)
            return Worker.spawn(plan, None)
        host_user = self._host_user
        assert host_user is not None
        limits = self.limits

        def prefix(seccomp_fd: int, info_fd: int, block_fd: int) -> list[str]:
            return bwrap_argv(
                self._bwrap, self._image, bootstrap_source(), limits.disk_mb, self._env(WORKDIR),
                seccomp_fd=seccomp_fd, info_fd=info_fd, userns_block_fd=block_fd, setpriv=host_user.setpriv,
            )  # fmt: skip

        uid, lease = host_user.lease_uid(n)
        plan = SpawnPlan(
            self._command(BOOTSTRAP_PATH),
            {},
            "/",
            bwrap_prefix=prefix,
            seccomp=self._seccomp,
            maps=host_user.maps(uid),
            lease_fd=lease,
            deny_setgroups=not host_user.drops_root,
            cgroup_limit=(limits.memory_mb + limits.disk_mb) * _MB,
            cgroup_name=f"w{n}",
        )
        return Worker.spawn(plan, self._cgroups)

    def _refill_loop(self) -> None:
        while True:
            self._refill_wanted.wait()
            self._refill_wanted.clear()
            if self._closed:
                return
            try:
                self._fill()
            except Exception as exc:  # noqa: BLE001 -- no warm worker: the next call starts its own (and says why)
                logger.warning("code tool: could not start a warm sandbox (%s: %s)", type(exc).__name__, exc)

    def _fill(self) -> None:
        while True:
            with self._lock:
                if self._closed or len(self._idle) >= self.limits.warm_pool:
                    return
            worker = self._spawn()
            with self._lock:
                if self._closed:
                    worker.close(self._cgroups)
                    return
                self._idle.append(worker)

    def _take(self) -> Worker:
        while True:
            with self._lock:
                worker = self._idle.popleft() if self._idle else None
            if worker is None:
                return self._spawn()
            if worker.proc.poll() is None:
                return worker
            worker.close(self._cgroups)  # died while waiting (outside the lock: closing may take a while)

    # -- running ------------------------------------------------------------------------------------

    def run(self, code: str) -> ExecutionResult:
        """Blocking: run ``code`` once in a fresh sandbox and collect its output. Never raises for the code's behaviour."""
        if self._closed:
            raise RuntimeError("Sandbox.run after close()")
        return self._execute(self._take(), code, refill=True)

    def _execute(self, worker: Worker, code: str, refill: bool = False) -> ExecutionResult:
        limits = self.limits
        with self._lock:
            self._busy.add(worker)
        try:
            worker.send(code.encode("utf-8", errors="replace"))
            if refill:
                self._refill_wanted.set()  # the replacement boots while this code runs
            seen = worker.collect(limits.timeout_s, 4 * limits.max_output_chars, int(limits.max_file_mb * _MB))
            rc = worker.proc.returncode
        finally:
            with self._lock:
                self._busy.discard(worker)
            worker.close(self._cgroups)
        stdout, out_cut = seen.stdout.text(limits.max_output_chars)
        stderr, err_cut = seen.stderr.text(limits.max_output_chars)
        stopped = seen.timed_out or seen.output_exceeded
        sig = None if stopped else _signal_of(rc, limits.sandbox)
        return ExecutionResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=None if stopped or sig is not None else rc,
            signal_name=sig,
            timed_out=seen.timed_out,
            duration_s=seen.duration_s,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            isolation=limits.sandbox,
            output_limit_exceeded=seen.output_exceeded,
        )

    def close(self) -> None:
        """Kill every worker, idle or running (a running execution then returns as killed); idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
            busy = list(self._busy)
        if hasattr(self, "_refill_wanted"):
            self._refill_wanted.set()  # the refill thread sees the sandbox closed and ends
        for worker in busy:
            worker.kill()  # its execution's thread sees it end and releases it
        for worker in idle:
            worker.close(self._cgroups)


# Host-side state is per process (shared by its sandboxes), named after the process, removed by close_all().
_worker_numbers = itertools.count()
_process_lock = threading.Lock()
_owner: OwnerTag | None = None
_cgroups_found: tuple[MemoryCgroups | None, str] | None = None
_state_dir: Path | None = None


def _this_owner() -> OwnerTag:
    global _owner
    if _owner is None or _owner.pid != os.getpid():
        _owner = OwnerTag.this_process()
    return _owner


def _process_cgroups() -> tuple[MemoryCgroups | None, str]:
    """This process's directory of sandbox memory cgroups (found once; stale ones of dead trainers removed)."""
    global _cgroups_found
    with _process_lock:
        if _cgroups_found is None or (_cgroups_found[0] is not None and _cgroups_found[0].owner != _this_owner()):
            _cgroups_found = MemoryCgroups.discover(_this_owner())
        return _cgroups_found


def _process_state_dir() -> Path:
    """unsafe mode: this process's directory of working directories (stale ones of dead trainers removed).

    Made by ``mkdtemp`` (a new, private directory; the owner tag is only its name's prefix), so another
    local user cannot prepare it in advance.
    """
    global _state_dir
    with _process_lock:
        if _state_dir is None or not _state_dir.name.startswith(f"{_STATE_PREFIX}.{_this_owner()}."):
            base = Path(tempfile.gettempdir())
            for entry in stale_entries(base, _STATE_PREFIX):
                if entry.is_dir() and not entry.is_symlink() and entry.lstat().st_uid == os.geteuid():
                    shutil.rmtree(entry, ignore_errors=True)
                    logger.info("code tool: removed the sandbox directory of a trainer that is gone (%s)", entry)
            _state_dir = Path(tempfile.mkdtemp(prefix=f"{_STATE_PREFIX}.{_this_owner()}.", dir=base))
        return _state_dir


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


def close_all() -> None:
    """Close every sandbox of this process: kill its workers, remove its host-side state (at exit, and on demand)."""
    global _cgroups_found, _state_dir
    with _sandboxes_lock:
        mine = [s for (pid, _), s in _sandboxes.items() if pid == os.getpid()]
        for key in [k for k in _sandboxes if k[0] == os.getpid()]:
            del _sandboxes[key]
    for sandbox in mine:
        sandbox.close()
    with _process_lock:
        if _cgroups_found is not None and _cgroups_found[0] is not None and _cgroups_found[0].owner == _this_owner():
            _cgroups_found[0].close()
        if _state_dir is not None and _state_dir.name.startswith(f"{_STATE_PREFIX}.{_this_owner()}."):
            shutil.rmtree(_state_dir, ignore_errors=True)
        _cgroups_found = _state_dir = None


atexit.register(close_all)
# Also before the interpreter joins the executor threads at exit, so a running execution is killed, not waited for.
# Those hooks run last-registered first, and concurrent.futures registers the join when its thread module is
# imported: import it first.
if hasattr(threading, "_register_atexit"):
    import concurrent.futures.thread  # noqa: F401

    threading._register_atexit(close_all)
