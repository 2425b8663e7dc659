"""Per-execution memory cgroups: everything an execution can pin in RAM, counted and capped by the kernel.

The address-space limit (``RLIMIT_AS``) sees only a process's mappings. RAM can also be pinned
outside them: a ``memfd`` or System V segment written and unmapped, tmpfs pages, pipe and socket
buffers. A memory cgroup charges all of these (kernel memory included) to the execution; at its
limit the kernel reclaims, then kills inside that cgroup only. Each sandbox gets one, created
before its code can run (bwrap waits while the trainer moves its processes in), removed when the
execution ends.

Where the hierarchy lives, in order of preference:

* cgroup v2 (a ``cgroup2`` mount with the ``memory`` controller): under the trainer's cgroup when
  that is the root of the hierarchy (a VM, a host); else a directory next to it, inside its parent,
  when that parent is a job's own level (Slurm's ``job_N/step_M/user``, a batch system's
  directory), so the job's limits still hold. Never next to a systemd unit (a parent named
  ``*.slice``, such as ``system.slice``: a sibling there would leave the service's or the
  container's limits) nor at the root for a trainer below it. The kernel forbids controllers in a
  cgroup that holds processes, so those are the only places; nothing is enabled on a parent;
* cgroup v1 (a ``memory`` hierarchy): a directory under the trainer's own memory cgroup.

Each trainer process owns one directory, ``mcore_agentic_sandbox.<owner tag>`` (:mod:`.owner`), with
one child per sandbox. :meth:`MemoryCgroups.discover` removes directories whose owner process is gone
(a trainer of the same PID namespace killed before it could clean up), killing anything left inside
first.

Where none is writable (an unprivileged trainer without a delegated v2 subtree, a container
with a read-only ``/sys/fs/cgroup``), :meth:`MemoryCgroups.discover` returns ``None`` and the
sandbox denies the routes a cgroup would have counted instead (:mod:`.seccomp`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from mcore_agentic.tools.owner import OwnerTag, stale_entries

logger = logging.getLogger(__name__)

PREFIX = "mcore_agentic_sandbox"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                    point = fields[4].replace("\\040", " ")
                    out.append((point, rfields[0], set(rfields[2].split(","))))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"": v2 path, "memory": v1 path, ...}``."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    out[name] = path
    except OSError:
        pass
    return out


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@dataclass
class Cgroup:
    """One execution's cgroup."""

    path: Path
    version: int

    def add(self, pid: int) -> None:
        """Move process ``pid`` (whose children are not born yet) into this cgroup."""
        _write(self.path / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> None:
        """SIGKILL every process left in the cgroup (normally none: the sandbox's namespace is gone)."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(self.path / "cgroup.kill", "1")
                return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, attempts: int = 50) -> bool:
        """Remove the (emptied) cgroup; False if processes still hold it after ``attempts`` tries."""
        for _ in range(attempts):
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                self.kill()
                time.sleep(0.01)
        return False


class MemoryCgroups:
    """This process's directory of per-execution memory cgroups."""

    def __init__(self, parent: Path, version: int, owner: OwnerTag):
        self.owner = owner
        self.version = version
        self.root = parent / f"{PREFIX}.{owner}"
        self._pending: list[Cgroup] = []
        self.root.mkdir(exist_ok=True)
        if version == 2:
            _write(self.root / "cgroup.subtree_control", "+memory")

    @classmethod
    def discover(cls, owner: OwnerTag) -> tuple[MemoryCgroups | None, str]:
        """A writable memory hierarchy for ``owner``'s sandboxes, or ``None``; and one line saying which, or why not."""
        own = _own_paths()
        reasons = []
        for point, fstype, options in _mounts():
            if fstype == "cgroup2" and "" in own:
                parents = _v2_parents(Path(point), own[""])
                if not parents:
                    reasons.append(
                        f"cgroup v2 at {point}: no memory-delegating parent inside the trainer's own limits "
                        f"(the trainer's cgroup is {own['']})"
                    )
                for parent in parents:
                    found, reason = cls._try(parent, 2, owner)
                    if found is not None:
                        return found, f"cgroup v2 memory controller under {parent}"
                    reasons.append(reason)
            elif fstype == "cgroup" and "memory" in options and "memory" in own:
                parent = Path(point) / own["memory"].lstrip("/")
                found, reason = cls._try(parent, 1, owner)
                if found is not None:
                    return found, f"cgroup v1 memory controller under {parent}"
                reasons.append(reason)
        return None, "; ".join(reasons) or "no cgroup hierarchy with a memory controller is mounted"

    @classmethod
    def _try(cls, parent: Path, version: int, owner: OwnerTag) -> tuple[MemoryCgroups | None, str]:
        try:
            _reclaim(parent, version)
            groups = cls(parent, version, owner)
            probe = groups.create("probe", 64 << 20)
            probe.remove()
            return groups, ""
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(parent / f"{PREFIX}.{owner}")
            return None, f"{parent} is not writable ({exc.strerror or exc})"

    def create(self, name: str, limit_bytes: int) -> Cgroup:
        """A cgroup for one execution, capped at ``limit_bytes`` of RAM (swap included where the kernel counts it)."""
        group = Cgroup(self.root / name, self.version)
        group.path.mkdir()
        try:
            if self.version == 2:
                _write(group.path / "memory.max", str(limit_bytes))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    _write(group.path / "memory.swap.max", "0")
                with contextlib.suppress(OSError):
                    _write(group.path / "memory.oom.group", "1")
            else:
                _write(group.path / "memory.limit_in_bytes", str(limit_bytes))
                with contextlib.suppress(OSError):  # memory + swap; absent without swap accounting
                    _write(group.path / "memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError:
            group.remove()
            raise
        return group

    def release(self, group: Cgroup) -> None:
        """Kill what is left in ``group`` and remove it; kept for :meth:`close` if the kernel is still tearing down."""
        group.kill()
        if not group.remove(attempts=5):
            self._pending.append(group)

    def close(self) -> None:
        """Remove every cgroup of this process, and its directory."""
        pending, self._pending = self._pending, []
        for group in pending:
            group.remove()
        for child in _children(self.root):
            Cgroup(child, self.version).remove()
        with contextlib.suppress(OSError):
            os.rmdir(self.root)


def _children(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []


def _v2_parents(mount: Path, own: str) -> list[Path]:
    """Where a v2 directory of sandbox cgroups may go (see the module docstring): a list of none or one."""
    here = mount / own.strip("/")
    if own.strip("/") == "":
        parent = here  # the trainer is at the root: under it
    elif here.parent == mount or here.parent.name.endswith(".slice"):
        return []  # a sibling would leave the trainer's (service's, container's) limits
    else:
        parent = here.parent
    try:
        delegated = "memory" in (parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return []
    return [parent] if delegated else []


def _reclaim(parent: Path, version: int) -> None:
    """Remove the sandbox cgroups of trainer processes that are gone (killed before they could clean up)."""
    for entry in stale_entries(parent, PREFIX):
        for child in _children(entry):
            Cgroup(child, version).remove()
        try:
            os.rmdir(entry)
            logger.info("code tool: removed the sandbox cgroups of a trainer that is gone (%s)", entry)
        except OSError as exc:
            logger.warning("code tool: could not remove stale sandbox cgroups %s (%s)", entry, exc)
