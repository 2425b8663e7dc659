"""Which process owns a piece of host-side sandbox state, and whether that process is still alive.

State the code sandbox leaves on the host (per-execution cgroups, the working directories of
``unsafe_subprocess`` mode) lives under a name carrying its owner's tag, ``<prefix>.<pid>.<start
time>``. The start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22) tells a live owner
from a later process that reused its pid, so a new trainer can reclaim what a killed one left.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class OwnerTag:
    pid: int
    start: int

    @classmethod
    def this_process(cls) -> OwnerTag:
        import os

        pid = os.getpid()
        return cls(pid, _start_time(pid) or 0)

    @classmethod
    def parse(cls, text: str) -> OwnerTag | None:
        pid, _, start = text.partition(".")
        if not (pid.isdigit() and start.isdigit()):
            return None
        return cls(int(pid), int(start))

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start

    def __str__(self) -> str:
        return f"{self.pid}.{self.start}"


def stale_entries(parent: Path, prefix: str) -> Iterator[Path]:
    """Entries ``<prefix>.<owner tag>`` of ``parent`` whose owner process is gone."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix + "."):
            continue
        tag = OwnerTag.parse(name[len(prefix) + 1 :])
        if tag is not None and not tag.alive():
            yield entry
