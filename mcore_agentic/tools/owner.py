"""Which process owns a piece of host-side sandbox state, and whether that process is still alive.

State the code sandbox leaves on the host (per-execution cgroups, the working directories of
``unsafe_subprocess`` mode) lives under a name carrying its owner's tag,
``<prefix>.<pid namespace>.<pid>.<start time>[.<suffix>]``. The start time (clock ticks since boot,
``/proc/<pid>/stat`` field 22) tells a live owner from a later process that reused its pid, so a
new trainer can reclaim what a killed one left. Only owners of the *same* PID namespace are judged:
a trainer in another container sharing the directory has pids this one cannot see, so its state
is never taken for a dead owner's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields restart after its last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22 overall


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class OwnerTag:
    pidns: int
    pid: int
    start: int

    @classmethod
    def this_process(cls) -> OwnerTag:
        pid = os.getpid()
        return cls(_pid_namespace(), pid, _start_time(pid) or 0)

    @classmethod
    def parse(cls, text: str) -> OwnerTag | None:
        """The tag at the start of ``text`` (whatever follows its three numbers), or None."""
        parts = text.split(".")
        if len(parts) < 3 or not all(p.isdigit() for p in parts[:3]):
            return None
        return cls(int(parts[0]), int(parts[1]), int(parts[2]))

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start

    def __str__(self) -> str:
        return f"{self.pidns}.{self.pid}.{self.start}"


def stale_entries(parent: Path, prefix: str) -> Iterator[Path]:
    """Entries ``<prefix>.<owner tag>...`` of ``parent`` whose owner, a process of this PID namespace, is gone."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    here = _pid_namespace()
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix + "."):
            continue
        tag = OwnerTag.parse(name[len(prefix) + 1 :])
        if tag is not None and tag.pidns == here and not tag.alive():
            yield entry
