"""A seccomp filter for the code sandbox: a classic-BPF program that bwrap loads (``--seccomp FD``).

It denies, with ``EPERM``, the system calls sandboxed code has no use for and that
widen the kernel's attack surface or reach outside the sandbox's namespaces:
tracing other processes, loading kernel modules or BPF, mounting, creating or
joining namespaces, io_uring, keyrings, ``open_by_handle_at``, clock and swap
changes (the list is the one container runtimes such as Docker and Flatpak deny).
Calls made with another ABI than the native one (i386 or x32 on x86-64) are
denied too, so the numbers cannot be bypassed.

With ``allow_processes=False`` it also denies ``fork``, ``vfork`` and ``clone``:
no new processes or threads. This matters because ``RLIMIT_NPROC`` does not bind
a sandbox whose user maps to host root (the kernel exempts root's processes),
so the filter is what enforces ``max_processes: 0`` there. ``clone3`` always
fails with ``ENOSYS`` (its flags live in memory a filter cannot read), which
makes the C library fall back to ``clone``.

Only x86-64 and aarch64 are described; elsewhere :func:`build_filter` returns
``None`` and the sandbox runs without this layer (namespaces still apply).
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes (linux/filter.h, linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # struct seccomp_data
_X32_SYSCALL_BIT = 0x40000000

_DENIED = (
    "ptrace process_vm_readv process_vm_writev kexec_load kexec_file_load init_module finit_module "
    "delete_module bpf perf_event_open userfaultfd keyctl add_key request_key mount umount2 pivot_root "
    "chroot unshare setns io_uring_setup io_uring_enter io_uring_register open_by_handle_at "
    "name_to_handle_at fanotify_init open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr "
    "syslog acct swapon swapoff reboot quotactl settimeofday clock_settime adjtimex iopl ioperm modify_ldt"
).split()
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
            adjtimex=171, clone=220, clone3=435,
        ),  # fmt: skip
    ),
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(allow_processes: bool, machine: str | None = None) -> bytes | None:
    """The filter as bytes of ``struct sock_filter``, or ``None`` on an architecture not described here."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, numbers = arch
    denied = [numbers[name] for name in _DENIED if name in numbers]
    if not allow_processes:
        denied += [numbers[name] for name in _PROCESS_CREATION if name in numbers]
    # Each test jumps to DENY (the last instruction) when it matches; offsets count from the next instruction.
    tests: list[tuple[int, int]] = []  # (opcode, k)
    if audit_arch == _ARCHES["x86_64"][0]:
        tests.append((_JGE_K, _X32_SYSCALL_BIT))  # x32 ABI numbers carry this bit
    tests += [(_JEQ_K, nr) for nr in denied]
    tail = [
        _insn(_JEQ_K, 0, 1, numbers["clone3"]),
        _insn(_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
    ]
    deny = _insn(_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)
    program = [
        _insn(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        _insn(_JEQ_K, 1, 0, audit_arch),  # another ABI: fall into the next RET
        deny,
        _insn(_LD_W_ABS, 0, 0, _NR_OFFSET),
    ]
    for i, (opcode, k) in enumerate(tests):
        to_deny = (len(tests) - i - 1) + len(tail)
        program.append(_insn(opcode, to_deny, 0, k))
    program += tail + [deny]
    if len(tests) + len(tail) > 255:
        raise AssertionError("seccomp program too long for 8-bit jump offsets")
    return b"".join(program)
