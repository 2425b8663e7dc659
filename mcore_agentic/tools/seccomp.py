"""A seccomp filter for the code sandbox: a classic-BPF program that bwrap loads (``--seccomp FD``).

It denies, with ``EPERM``:

* what sandboxed code has no use for and that widens the kernel's attack surface or
  reaches outside the sandbox's namespaces: tracing other processes, loading kernel
  modules or BPF, mounting, creating or joining namespaces (``unshare``, ``setns``,
  and ``clone`` with any ``CLONE_NEW*`` flag: this is what stops the code from making
  user namespaces), io_uring, keyrings, ``open_by_handle_at``, clock and swap changes
  (the list container runtimes such as Docker and Flatpak deny);
* the ways one execution could observe another through the files they share (the
  read-only interpreter and libraries): page-cache residency probes (``mincore``,
  ``cachestat``, ``preadv2``/``pwritev2``, whose ``RWF_NOWAIT`` reports it) and
  eviction (``fadvise64``, ``madvise(MADV_PAGEOUT | MADV_COLD)``, ``process_madvise``),
  file-change notification (``inotify``, ``fcntl(F_NOTIFY)``, ``fanotify``), leases
  (``fcntl(F_SETLEASE)``: an ordinary trainer's sandbox owns that trainer's files, and a
  lease would stall the trainer's own opens), ``flock`` and POSIX lock queries
  (``fcntl(F_GETLK)``, ``F_OFD_GETLK``). On a read-only file a process can only take read
  locks, which never conflict, so without the queries POSIX locks carry nothing; the
  sandbox's own files keep working locks (sqlite);
* with ``deny_unbounded_ram`` (no memory cgroup bounds the execution): the routes to
  kernel memory the address-space limit does not see, ``memfd_create``, ``memfd_secret``
  and System V IPC objects (``shmget``, ``semget``, ``msgget``: a fresh IPC namespace allows
  32000 semaphore sets of 32000, gigabytes; ``/dev/shm`` is not writable, tmpfs is capped
  by ``disk_mb``);
* with ``allow_processes=False``: ``fork``, ``vfork`` and ``clone``, no new processes or
  threads.

Calls made with another ABI than the native one (i386 or x32 on x86-64) are denied, so
the numbers cannot be bypassed; ``clone3`` always fails with ``ENOSYS`` (its flags live
in memory a filter cannot read), which makes the C library fall back to ``clone``.

Only x86-64 and aarch64 are described; elsewhere :func:`build_filter` returns ``None``
and the sandbox refuses to start (the filter is what keeps user namespaces closed).
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes (linux/filter.h, linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # struct seccomp_data
_ARG_OFFSET = 16  # args[i] at 16 + 8 i; both described ABIs are little-endian, so the low word comes first
_X32_SYSCALL_BIT = 0x40000000

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME (linux/sched.h).
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
# fcntl commands that let one process see or stall another's use of a shared file (linux/fcntl.h).
F_GETLK, F_OFD_GETLK, F_NOTIFY, F_SETLEASE = 5, 36, 1026, 1024
# madvise advice that evicts shared file pages from the page cache (linux/mman-common.h).
MADV_COLD, MADV_PAGEOUT = 20, 21

_DENIED = (
    "ptrace process_vm_readv process_vm_writev kexec_load kexec_file_load init_module finit_module "
    "delete_module bpf perf_event_open userfaultfd keyctl add_key request_key mount umount2 pivot_root "
    "chroot unshare setns io_uring_setup io_uring_enter io_uring_register open_by_handle_at "
    "name_to_handle_at fanotify_init open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr "
    "syslog acct swapon swapoff reboot quotactl settimeofday clock_settime adjtimex iopl ioperm modify_ldt "
    "pidfd_getfd "
    # shared-file observation: page-cache probes and eviction, notification, whole-file locks
    "mincore cachestat preadv2 pwritev2 fadvise64 inotify_init inotify_init1 inotify_add_watch flock process_madvise"
).split()
SHARED_FILE_CALLS = ("mincore", "cachestat", "preadv2", "pwritev2", "fadvise64", "inotify_init", "inotify_init1",
                     "inotify_add_watch", "flock", "process_madvise", "fcntl_getlk")
"""The calls of :data:`_DENIED` that observe the files executions share (not the kernel's attack surface);
``fcntl_getlk`` names ``fcntl``'s lock queries (``F_GETLK``, ``F_OFD_GETLK``)."""
_UNBOUNDED_RAM = ("memfd_create", "memfd_secret", "shmget", "semget", "msgget")
_PROCESS_CREATION = ("fork", "vfork", "clone")

# (AUDIT_ARCH value, syscall numbers) from the kernel's unistd headers; absent names do not exist there.
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        dict(
            ptrace=101, process_vm_readv=310, process_vm_writev=311, kexec_load=246, kexec_file_load=320,
            init_module=175, finit_module=313, delete_module=176, bpf=321, perf_event_open=298,
            userfaultfd=323, keyctl=250, add_key=248, request_key=249, mount=165, umount2=166,
            pivot_root=155, chroot=161, unshare=272, setns=308, io_uring_setup=425, io_uring_enter=426,
            io_uring_register=427, open_by_handle_at=304, name_to_handle_at=303, fanotify_init=300,
            open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
            mount_setattr=442, syslog=103, acct=163, swapon=167, swapoff=168, reboot=169, quotactl=179,
            settimeofday=164, clock_settime=227, adjtimex=159, iopl=172, ioperm=173, modify_ldt=154,
            pidfd_getfd=438, mincore=27, cachestat=451, preadv2=327, pwritev2=328, fadvise64=221,
            inotify_init=253, inotify_init1=294, inotify_add_watch=254, flock=73, fcntl=72,
            memfd_create=319, memfd_secret=447, shmget=29, semget=64, msgget=68, madvise=28, process_madvise=440,
            clone=56, fork=57, vfork=58, clone3=435,
        ),  # fmt: skip
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            ptrace=117, process_vm_readv=270, process_vm_writev=271, kexec_load=104, kexec_file_load=294,
            init_module=105, finit_module=273, delete_module=106, bpf=280, perf_event_open=241,
            userfaultfd=282, keyctl=219, add_key=217, request_key=218, mount=40, umount2=39, pivot_root=41,
            chroot=51, unshare=97, setns=268, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
            open_by_handle_at=265, name_to_handle_at=264, fanotify_init=262, open_tree=428, move_mount=429,
            fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, syslog=116, acct=89,
            swapon=224, swapoff=225, reboot=142, quotactl=60, settimeofday=170, clock_settime=112,
            adjtimex=171, pidfd_getfd=438, mincore=232, cachestat=451, preadv2=286, pwritev2=287,
            fadvise64=223, inotify_init1=26, inotify_add_watch=27, flock=32, fcntl=25,
            memfd_create=279, memfd_secret=447, shmget=194, semget=190, msgget=186, madvise=233, process_madvise=440,
            clone=220, clone3=435,
        ),  # fmt: skip
    ),
}


class _Program:
    """A forward-only BPF program with symbolic jump targets, resolved by :meth:`assemble`."""

    def __init__(self) -> None:
        self.code: list[tuple[int, str | int, str | int, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def op(self, code: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self.code.append((code, jt, jf, k))

    def assemble(self) -> bytes:
        out = []
        for i, (code, jt, jf, k) in enumerate(self.code):
            offsets = []
            for target in (jt, jf):
                off = self.labels[target] - i - 1 if isinstance(target, str) else target
                if not 0 <= off <= 255:
                    raise AssertionError(f"seccomp jump of {off} at {i} does not fit 8 bits")
                offsets.append(off)
            out.append(struct.pack("=HBBI", code, offsets[0], offsets[1], k))
        return b"".join(out)


def build_filter(allow_processes: bool, *, deny_unbounded_ram: bool = True, machine: str | None = None,
                 allow: tuple[str, ...] = ()) -> bytes | None:
    """The filter as bytes of ``struct sock_filter``, or ``None`` on an architecture not described here.

    ``allow``: names of the shared-file observation list (:data:`SHARED_FILE_CALLS`) to let through anyway (a
    harness's toolchain needs ``flock`` and ``inotify``: :mod:`.command_sandbox`)."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, numbers = arch
    assert set(allow) <= set(SHARED_FILE_CALLS), sorted(set(allow) - set(SHARED_FILE_CALLS))
    names = [n for n in _DENIED if n not in allow] + (list(_UNBOUNDED_RAM) if deny_unbounded_ram else [])
    if not allow_processes:
        names += _PROCESS_CREATION
    denied = [numbers[name] for name in names if name in numbers]

    p = _Program()
    p.op(_LD_W_ABS, _ARCH_OFFSET)
    p.op(_JEQ_K, audit_arch, jf="deny")  # another ABI: denied
    p.op(_LD_W_ABS, _NR_OFFSET)
    if audit_arch == _ARCHES["x86_64"][0]:
        p.op(_JGE_K, _X32_SYSCALL_BIT, jt="deny")  # x32 ABI numbers carry this bit
    for nr in denied:
        p.op(_JEQ_K, nr, jt="deny")
    if allow_processes:
        p.op(_JEQ_K, numbers["clone"], jt="clone")
    p.op(_JEQ_K, numbers["fcntl"], jt="fcntl")
    p.op(_JEQ_K, numbers["madvise"], jt="madvise")
    p.op(_JEQ_K, numbers["clone3"], jt="enosys")
    p.op(_RET_K, _RET_ALLOW)
    p.label("enosys")
    p.op(_RET_K, _RET_ERRNO | errno.ENOSYS)
    p.label("deny")
    p.op(_RET_K, _RET_ERRNO | errno.EPERM)
    if allow_processes:  # clone(flags, ...): no new namespaces
        p.label("clone")
        p.op(_LD_W_ABS, _ARG_OFFSET)
        p.op(_JSET_K, CLONE_NAMESPACE_FLAGS, jt="deny_arg")
        p.op(_RET_K, _RET_ALLOW)
    p.label("fcntl")  # fcntl(fd, cmd, ...): no lock queries, no directory notifications, no leases
    p.op(_LD_W_ABS, _ARG_OFFSET + 8)
    for cmd in ((F_NOTIFY, F_SETLEASE) if "fcntl_getlk" in allow else (F_GETLK, F_OFD_GETLK, F_NOTIFY, F_SETLEASE)):
        p.op(_JEQ_K, cmd, jt="deny_arg")
    p.op(_RET_K, _RET_ALLOW)
    p.label("madvise")  # madvise(addr, len, advice): no eviction of (shared) file pages
    p.op(_LD_W_ABS, _ARG_OFFSET + 16)
    for advice in (MADV_COLD, MADV_PAGEOUT):
        p.op(_JEQ_K, advice, jt="deny_arg")
    p.op(_RET_K, _RET_ALLOW)
    p.label("deny_arg")
    p.op(_RET_K, _RET_ERRNO | errno.EPERM)
    return p.assemble()
