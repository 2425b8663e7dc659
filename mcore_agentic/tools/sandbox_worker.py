"""One sandbox process tree, started ahead of its code and used once: spawn, hand over code, collect, kill.

A :class:`Worker` owns

* the ``bwrap`` process and, through a pidfd, the init of the sandbox's PID namespace: killing
  that init makes the kernel kill every process of the namespace (``setsid`` and double forks
  included) before the init can exit;
* three pipes: the code goes in on stdin; stdout and stderr come back on pipes the trainer
  drains while the code runs, keeping the head and the tail of each (:class:`OutputCapture`),
  and stopping the execution when either passes the output cap. No file of the host holds an
  execution's output, so nothing the code does to its descriptors (``fallocate``, ``fchmod``,
  xattrs) reaches the host's disk;
* its memory cgroup, when the host has one (:mod:`.memory_cgroup`).

bwrap builds the namespaces, reports the sandbox's pid and waits; :meth:`Worker.spawn` then
writes the user namespace's maps (:mod:`.host_user`), moves the sandbox's init (the parent of
everything the code runs) into the execution's cgroup and lets it go on, so the interpreter
starts unprivileged and charged to its cgroup. In ``unsafe_subprocess`` mode the worker is a plain subprocess in its own session,
with a working directory on the host that :meth:`Worker.close` removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mcore_agentic.tools.memory_cgroup import Cgroup, MemoryCgroups

KILL_GRACE_S = 10.0
_CHUNK = 1 << 16


class OutputCapture:
    """The head and the tail of a stream, ``window`` bytes each, and its total size."""

    def __init__(self, window: int):
        self.window = window
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.window - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.window:
                del self.tail[: len(self.tail) - self.window]

    def text(self, limit: int) -> tuple[str, bool]:
        """The text cut to ``limit`` characters, keeping its head and its tail (where tracebacks end)."""
        complete = self.total <= len(self.head) + len(self.tail)
        if complete:
            head = tail = (self.head + self.tail).decode("utf-8", errors="replace")
            if len(head) <= limit:
                return head, False
        else:
            head = self.head.decode("utf-8", errors="replace")
            tail = self.tail.decode("utf-8", errors="replace")
        half = limit // 2
        return f"{head[:half]}\n...[output truncated]...\n{tail[-half:]}", True


@dataclass
class Collected:
    """What :meth:`Worker.collect` saw."""

    stdout: OutputCapture
    stderr: OutputCapture
    timed_out: bool
    output_exceeded: bool
    duration_s: float


@dataclass(frozen=True)
class SpawnPlan:
    """How to start one worker (built by the sandbox for each)."""

    command: list[str]
    """The interpreter and its arguments."""
    env: dict[str, str] | None
    cwd: str
    workdir: Path | None = None
    """unsafe mode: the host directory the code works in (removed by :meth:`Worker.close`)."""
    bwrap_prefix: Callable[[int, int, int], list[str]] | None = None
    """bwrap mode: ``(seccomp_fd, info_fd, userns_block_fd) -> bwrap argv up to --``."""
    seccomp: bytes | None = None
    maps: tuple[str, str] | None = None
    """(uid_map, gid_map) the trainer writes into the sandbox's user namespace."""
    deny_setgroups: bool = True
    """Write ``deny`` to the namespace's ``setgroups`` (required when the trainer is unprivileged); a root trainer's
    sandbox keeps it allowed so that its bootstrap can drop the supplementary groups bwrap inherited (group 0)."""
    cgroup_limit: int | None = None
    cgroup_name: str = ""
    lease_fd: int | None = None
    """Holds the host uid the sandbox runs as (:meth:`.host_user.HostUser.lease_uid`); the worker closes it."""


class Worker:
    """One started sandbox waiting for its code; used once.

    :meth:`kill` and :meth:`close` may be called from two threads at once (the execution's, and
    :meth:`.sandbox.Sandbox.close` at exit): one lock orders them, and neither acts on a closed worker.
    """

    def __init__(self, proc: subprocess.Popen, exit_fd: int, workdir: Path | None = None, lease_fd: int | None = None):
        self.proc = proc
        self.exit_fd = exit_fd
        """pidfd of ``proc``: readable once it has exited."""
        self.init_fd: int | None = None
        """pidfd of the sandbox's PID-namespace init (bwrap mode)."""
        self.cgroup: Cgroup | None = None
        self.workdir = workdir
        self.lease_fd = lease_fd
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def spawn(cls, plan: SpawnPlan, cgroups: MemoryCgroups | None) -> Worker:
        """Start a worker; in bwrap mode returns once its namespaces are mapped and it sits in its cgroup."""
        if plan.bwrap_prefix is None:
            proc = subprocess.Popen(
                plan.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=plan.cwd, env=plan.env, close_fds=True, start_new_session=True,
            )  # fmt: skip
            return cls(proc, os.pidfd_open(proc.pid), workdir=plan.workdir)
        ours: list[int] = []  # our ends, closed on the way out
        theirs: list[int] = []  # bwrap's ends, closed once it has them
        worker: Worker | None = None
        try:
            seccomp_r, seccomp_w = os.pipe()
            theirs.append(seccomp_r)
            ours.append(seccomp_w)
            info_r, info_w = os.pipe()
            ours.append(info_r)
            theirs.append(info_w)
            block_r, block_w = os.pipe()
            ours.append(block_w)
            theirs.append(block_r)
            argv = plan.bwrap_prefix(seccomp_r, info_w, block_r) + plan.command
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=plan.cwd,
                env=plan.env, close_fds=True, pass_fds=tuple(theirs), start_new_session=True,
            )  # fmt: skip (no user/group arguments: they would cost a fork of the whole trainer instead of a vfork)
            for fd in theirs:
                os.close(fd)
            theirs.clear()
            assert plan.seccomp is not None
            worker = cls(proc, os.pidfd_open(proc.pid), lease_fd=plan.lease_fd)
            try:
                with contextlib.suppress(BrokenPipeError):  # bwrap died at once: its stderr says why
                    os.write(seccomp_w, plan.seccomp)  # a few hundred bytes: fits the pipe, bwrap reads it later
                worker._attach(info_r, plan, cgroups)
                with contextlib.suppress(BrokenPipeError):
                    os.write(block_w, b"1")  # bwrap goes on; if set-up failed it has exited and its stderr says why
            except BaseException:
                worker.close(cgroups)
                raise
            return worker
        finally:
            for fd in ours + theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if worker is None and plan.lease_fd is not None:  # bwrap did not even start
                os.close(plan.lease_fd)

    def _attach(self, info_fd: int, plan: SpawnPlan, cgroups: MemoryCgroups | None) -> None:
        """Read the sandbox's pid, write its user namespace's maps, move it into its cgroup."""
        info = _read_all(info_fd, KILL_GRACE_S)
        if not info:
            if self.proc.poll() is None and not select.select([self.exit_fd], [], [], 1.0)[0]:
                raise RuntimeError(f"bwrap did not report its sandbox within {KILL_GRACE_S:g} s")  # never let it go on
            return  # bwrap failed before the namespaces existed: it has exited, its stderr says why
        child = int(json.loads(info)["child-pid"])
        self.init_fd = os.pidfd_open(child)  # bwrap's child waits for us: the pid cannot have been reused
        assert plan.maps is not None
        uid_map, gid_map = plan.maps
        proc_dir = f"/proc/{child}"
        with open(f"{proc_dir}/uid_map", "w") as f:
            f.write(uid_map)
        if plan.deny_setgroups:
            with open(f"{proc_dir}/setgroups", "w") as f:
                f.write("deny\n")
        with open(f"{proc_dir}/gid_map", "w") as f:
            f.write(gid_map)
        if cgroups is not None and plan.cgroup_limit is not None:
            self.cgroup = cgroups.create(plan.cgroup_name, plan.cgroup_limit)
            # The interpreter is forked from the namespace's init after this, so it and everything it starts are
            # charged here. (bwrap's outer process runs no code of the model's; each move costs the kernel a grace
            # period, so it stays where it is.)
            self.cgroup.add(child)

    # -- one execution --------------------------------------------------------------------------------

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

    def collect(self, timeout_s: float, window: int, cap_bytes: int) -> Collected:
        """Drain stdout and stderr until the worker exits, ``timeout_s`` passes, or a stream passes ``cap_bytes``.

        Then kills everything the worker started, and reads what the pipes still hold.
        """
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out, err = OutputCapture(window), OutputCapture(window)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ, out)
        sel.register(self.proc.stderr, selectors.EVENT_READ, err)
        sel.register(self.exit_fd, selectors.EVENT_READ, None)
        start = time.monotonic()
        deadline = start + timeout_s
        timed_out = exceeded = exited = False
        try:
            while not exited and not exceeded:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(remaining):
                    if key.data is None:
                        exited = True
                        sel.unregister(key.fileobj)
                    elif not _drain_once(sel, key):
                        continue
                    elif key.data.total > cap_bytes:
                        exceeded = True
            duration = time.monotonic() - start
            self.kill()  # also ends whatever the code left running
            with contextlib.suppress(KeyError):
                sel.unregister(self.exit_fd)
            grace = time.monotonic() + KILL_GRACE_S
            while sel.get_map() and time.monotonic() < grace:  # every writer is dead: EOF follows
                for key, _ in sel.select(max(0.0, grace - time.monotonic())):
                    if _drain_once(sel, key) and key.data.total > cap_bytes:
                        exceeded = True
                        sel.unregister(key.fileobj)
        finally:
            sel.close()
        return Collected(out, err, timed_out, exceeded, duration)

    def kill(self) -> None:
        """Kill everything this worker started and return once it is all gone; nothing once closed."""
        with self._lock:
            if not self._closed:
                self._kill()

    def _kill(self) -> None:
        if self.init_fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.init_fd, signal.SIGKILL)  # the kernel then kills the whole namespace
            # Readable once the init has exited, which it does only after every process of its namespace is reaped.
            select.select([self.init_fd], [], [], KILL_GRACE_S)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its session's process group (unsafe mode)
        if self.cgroup is not None:
            self.cgroup.kill()
        try:
            self.proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self, cgroups: MemoryCgroups | None = None) -> None:
        """Kill (if still running) and release everything: descriptors, cgroup, uid lease, host working directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.proc.returncode is None:
                self._kill()
            self._release(cgroups)

    def _release(self, cgroups: MemoryCgroups | None) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        for fd in (self.exit_fd, self.init_fd, self.lease_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.init_fd = self.lease_fd = None
        if self.cgroup is not None:
            if cgroups is not None:
                cgroups.release(self.cgroup)
            else:
                self.cgroup.kill()
                self.cgroup.remove()
            self.cgroup = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def _drain_once(sel: selectors.BaseSelector, key: selectors.SelectorKey) -> bool:
    """Read one chunk of a registered pipe into its capture; False (and unregistered) at EOF."""
    try:
        chunk = os.read(key.fd, _CHUNK)
    except OSError:
        chunk = b""
    if not chunk:
        sel.unregister(key.fileobj)
        return False
    key.data.add(chunk)
    return True


def _read_all(fd: int, timeout_s: float) -> bytes:
    """Everything written to ``fd`` until its writer closes it, or what arrived within ``timeout_s``."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return data
        chunk = os.read(fd, 65536)
        if not chunk:
            return data
        data += chunk
