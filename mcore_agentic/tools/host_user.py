"""Which host uid a sandbox's processes run as, and the user-namespace maps that make it so.

bwrap builds each sandbox's user namespace and then waits (``--userns-block-fd``) while the
trainer writes the namespace's uid and gid maps (:meth:`HostUser.maps`):

* **trainer is an ordinary user**: ``65534 <trainer uid> 1``. Inside, the code is uid 65534; on
  the host it is the trainer's own uid, which is unprivileged (it is also the only uid an
  unprivileged process may map).
* **trainer is root** (``host_user: auto``, the default): ``0 0 1`` and ``65534 <X> 1``, where X is
  a *dedicated* uid taken from ``host_uid_range``, leased host-wide for the execution's lifetime
  (:meth:`HostUser.lease_uid`), so no two executions running at once share a uid's process count,
  pipe quota or signal queue, whichever trainer process on the host started them. bwrap sets the
  sandbox up as namespace root, which is host root for the files it binds, so an interpreter
  under a ``0700`` ``/root`` is still reached; then ``setpriv`` (util-linux) drops to 65534 (host
  uid X), clears the supplementary groups (the trainer's group 0 among them), the inheritable
  and the bounding capability sets, and only then executes the interpreter: nothing in the
  sandbox ever runs as host root after bwrap's own set-up. From then on the kernel sees an
  unprivileged user that owns no host file: ``/proc/sys`` and every root-only file are out of
  reach, and ``RLIMIT_NPROC`` binds (the kernel exempts only root).
* **trainer is root, ``host_user: trainer``**: ``65534 0 1``, the sandbox's uid *is* host root
  (what bubblewrap alone gives). A weaker mode a config must ask for; a warning says so.

A trainer whose "root" is not host root (a rootless container mapping its uid 0 onto an
unprivileged host uid) counts as root here when it can map a spare uid, and otherwise runs the
sandbox as its own uid, which is unprivileged on the host.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pwd
import shutil
import stat
import struct
import tempfile
from dataclasses import dataclass

from mcore_agentic.tools.bwrap import SANDBOX_UID

logger = logging.getLogger(__name__)

DEFAULT_UID_RANGE = (2_000_000_000, 65536)
"""Dedicated host uids for a root trainer's sandboxes: unused by every distribution, systemd
(its container range ends at 1879048191) and Kubernetes' user-namespace ranges."""
_RESERVED = frozenset({65534, 65535, 4294967294, 4294967295})
_FIRST_ORDINARY = 1000  # system accounts live below


class HostUserError(RuntimeError):
    """The sandbox cannot run unprivileged here; the message is one line with the cause and the fix."""


def read_id_map(path: str) -> list[tuple[int, int]]:
    """The ids mapped in this user namespace as ``[start, end)`` intervals (the inside column of ``path``)."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.strip()]
    except OSError:
        return [(0, 4294967295)]  # no user namespaces in this kernel: every id is ours
    return sorted((int(inside), int(inside) + int(count)) for inside, _outside, count in rows)


def _outside_of(path: str, inside_id: int) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                inside, outside, count = (int(x) for x in line.split())
                if inside <= inside_id < inside + count:
                    return outside + inside_id - inside
    except (OSError, ValueError):
        return inside_id
    return None


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in a:
        for lo2, hi2 in b:
            start, end = max(lo, lo2), min(hi, hi2)
            if start < end:
                out.append((start, end))
    return sorted(out)


def _covers(intervals: list[tuple[int, int]], first: int, count: int) -> bool:
    return any(lo <= first and first + count <= hi for lo, hi in intervals)


def pick_uid_range(mapped: list[tuple[int, int]], size: int = DEFAULT_UID_RANGE[1]) -> tuple[int, int] | None:
    """A block of spare ids in ``mapped``: the default range if it is mapped, else the top of the largest free stretch."""
    if _covers(mapped, *DEFAULT_UID_RANGE):
        return DEFAULT_UID_RANGE
    best: tuple[int, int] | None = None
    for lo, hi in mapped:
        lo = max(lo, _FIRST_ORDINARY)
        hi = min(hi, 65534) if lo < 65534 else min(hi, 4294967294)
        if hi - lo > (best[1] - best[0] if best else 0):
            best = (lo, hi)
    if best is None:
        return None
    lo, hi = best
    count = min(size, hi - lo)
    return (hi - count, count)


@dataclass(frozen=True)
class HostUser:
    """How sandboxes map onto host users in this process (see the module docstring)."""

    trainer_uid: int
    trainer_gid: int
    uid_range: tuple[int, int] | None
    """Dedicated host ids (first, count) when sandboxes run as their own uids (root trainer), else None."""
    excluded: frozenset[int] = frozenset()
    """Ids of the range that belong to an account of this system and are skipped."""
    setpriv: str | None = None
    """The ``setpriv`` that drops the sandbox from namespace root to :data:`SANDBOX_UID` (with ``uid_range``)."""

    @property
    def drops_root(self) -> bool:
        """Whether the sandbox is set up as namespace root and ``setpriv`` drops it to :data:`SANDBOX_UID`."""
        return self.uid_range is not None

    @property
    def is_host_root(self) -> bool:
        """Whether the sandbox's processes are host root (``host_user: trainer`` as root)."""
        return self.uid_range is None and self.trainer_uid == 0

    def lease_uid(self, n: int) -> tuple[int, int | None]:
        """The host uid (and gid) of execution ``n`` and the descriptor that holds it (None: nothing to hold).

        Under a root trainer: a dedicated id of the range that no other sandbox on this host holds. Each
        id is a one-byte lock (``F_OFD_SETLK``) in a root-only file (:func:`uid_lease_file`), held by the
        returned descriptor until it is closed, by the sandbox or by the kernel when its process dies: two
        trainer processes on one host (ranks, Ray workers) never hand out the same uid at once, and no
        state outlives them. Otherwise: the trainer's own uid.
        """
        if self.uid_range is None:
            return self.trainer_uid, None
        first, count = self.uid_range
        salt = (os.getpid() * 7919) % count  # different trainer processes start at different ids
        path = uid_lease_file()
        for step in range(count):
            uid = first + (salt + n + step) % count
            if uid in self.excluded:
                continue
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, uid - first, 1, 0))
                return uid, fd
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
        raise HostUserError(f"every id of host_uid_range {list(self.uid_range)} is in use by a sandbox of this host")

    def maps(self, host_uid: int) -> tuple[str, str]:
        """The ``(uid_map, gid_map)`` text for a sandbox that runs as ``host_uid`` (from :meth:`lease_uid`)."""
        if self.uid_range is None:
            return f"{SANDBOX_UID} {self.trainer_uid} 1\n", f"{SANDBOX_UID} {self.trainer_gid} 1\n"
        return f"0 0 1\n{SANDBOX_UID} {host_uid} 1\n", f"0 0 1\n{SANDBOX_UID} {host_uid} 1\n"


def uid_lease_file() -> str:
    """The host-wide file whose byte locks lease dedicated uids: in ``/run`` (root's), else the temporary directory.

    Created by root, mode 0600; one that exists owned by another user or that is not a plain file is refused.
    """
    for directory in ("/run", tempfile.gettempdir()):
        if os.access(directory, os.W_OK):
            path = os.path.join(directory, "mcore_agentic_sandbox.uids")
            break
    else:
        raise HostUserError("no writable /run or temporary directory for the sandbox's uid leases")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise HostUserError(f"{path} is not a file of this user: remove it (another user made it)")
    return path


def _system_ids() -> frozenset[int]:
    ids: set[int] = set()
    try:
        ids.update(entry.pw_uid for entry in pwd.getpwall())
        import grp

        ids.update(entry.gr_gid for entry in grp.getgrall())
    except (OSError, KeyError):
        pass
    return frozenset(ids) | _RESERVED


def resolve_host_user(host_user: str, uid_range: tuple[int, int] | None) -> HostUser:
    """The :class:`HostUser` for this process; :class:`HostUserError` when root cannot run the sandbox unprivileged."""
    uid, gid = os.geteuid(), os.getegid()
    if uid != 0 or host_user == "trainer":
        if uid_range is not None and uid != 0:
            raise HostUserError(
                f"host_uid_range {list(uid_range)} needs a trainer running as root (this one is uid {uid}, and its "
                "sandboxes run as its own unprivileged uid); remove the key"
            )
        return HostUser(trainer_uid=uid, trainer_gid=gid, uid_range=None)
    mapped = _intersect(read_id_map("/proc/self/uid_map"), read_id_map("/proc/self/gid_map"))
    if uid_range is not None:
        first, count = uid_range
        if count < 1 or first < 1 or not _covers(mapped, first, count):
            raise HostUserError(
                f"host_uid_range {list(uid_range)} must be [first uid, count] with count >= 1, inside the ids this "
                f"user namespace maps ({_show(mapped)}); pick another range or remove the key"
            )
        chosen: tuple[int, int] | None = (first, count)
    else:
        chosen = pick_uid_range(mapped)
    if chosen is None:
        if _outside_of("/proc/self/uid_map", 0) not in (0, None):
            logger.info("code tool: this trainer's root is not host root; its sandboxes run as its own uid")
            return HostUser(trainer_uid=uid, trainer_gid=gid, uid_range=None)
        raise HostUserError(
            "the trainer runs as root and its user namespace maps no spare uid to run model code as "
            f"({_show(mapped)}); run the trainer as an ordinary user, map more uids into the container, give "
            "host_uid_range, or set host_user: trainer (the sandbox then runs as host root: weaker)"
        )
    excluded = frozenset(i for i in _system_ids() if chosen[0] <= i < chosen[0] + chosen[1])
    if len(excluded) >= chosen[1]:
        raise HostUserError(f"every id of host_uid_range {list(chosen)} belongs to an account of this system; pick another")
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin:" + os.environ.get("PATH", ""))
    if setpriv is None:
        raise HostUserError(
            "the trainer runs as root, and the sandbox needs setpriv (util-linux) to start model code as an "
            "unprivileged uid; install util-linux, run the trainer as an ordinary user, or set host_user: trainer "
            "(the sandbox then runs as host root: weaker)"
        )
    return HostUser(trainer_uid=uid, trainer_gid=gid, uid_range=chosen, excluded=excluded, setpriv=os.path.realpath(setpriv))


def _show(intervals: list[tuple[int, int]]) -> str:
    return "mapped ids: " + ", ".join(f"{lo}..{hi - 1}" for lo, hi in intervals) if intervals else "no ids mapped"
