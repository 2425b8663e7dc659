"""Bootstrap run inside the sandbox: wait for the code, limit itself, then run the code.

Started by :mod:`mcore_agentic.tools.sandbox` as
``python -I -B -X utf8 sandbox_child.py '<json settings>'``, inside bubblewrap
(or, with ``sandbox: unsafe_subprocess``, as a plain subprocess). It imports
nothing from this project (``-I`` keeps the project off ``sys.path``) and, in order:

0. in a bwrap sandbox: checks that it is the sandbox uid with no group and no capability
   (exiting with :data:`DROP_FAILED` otherwise), before any code exists;
1. reads the code from stdin until EOF (a warm worker waits here, booted and
   ready; it imports only what every execution needs, since imports are paid per execution);
2. sets resource limits on itself (soft = hard, so the code cannot raise them):
   CPU seconds, address space, file size, open files, new processes, no core
   dumps, no locked memory, no POSIX message queues, few queued signals (the last
   three are per-user kernel counts shared with the trainer's uid). Doing this here
   rather than in ``subprocess``'s ``preexec_fn`` keeps
   the parent safe: ``preexec_fn`` may deadlock in a multi-threaded parent;
3. unsafe mode only: tries to move into a new, empty network namespace;
4. installs an audit hook (PEP 578) that refuses sockets, new processes,
   signals to other processes, ctypes calls and file access outside the
   working directory (reading the interpreter's own libraries stays allowed);
   it is a tripwire for honest mistakes, not a wall (tests/unit/tools/test_sandbox_escapes.py
   switches it off from inside before every attack);
5. runs the code as a fresh ``__main__`` module from ``<code>``, printing a
   traceback without this bootstrap's frames.

The audit hook is an inner layer only: CPython says hooks are no security
boundary, and determined code gets around them. The boundary is bubblewrap's
namespaces, the seccomp filter and the kernel's resource limits.
"""

import _thread
import json
import os
import resource
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
BLOCKED_PREFIXES = ("os.exec", "os.spawn", "ctypes.")
BLOCKED_EVENTS = frozenset(
    {
        "os.system",
        "os.posix_spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "subprocess.Popen",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
    }
)
# event -> (indices of path arguments, whether the access writes)
PATH_EVENTS = {
    "os.listdir": ((0,), False),
    "os.scandir": ((0,), False),
    "os.chdir": ((0,), False),
    "os.remove": ((0,), True),
    "os.rmdir": ((0,), True),
    "os.mkdir": ((0,), True),
    "os.rename": ((0, 1), True),
    "os.symlink": ((0, 1), True),
    "os.link": ((0, 1), True),
    "os.truncate": ((0,), True),
    "os.chmod": ((0,), True),
    "os.chown": ((0,), True),
    "os.utime": ((0,), True),
    "shutil.rmtree": ((0,), True),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
AF_UNIX = 1  # socket.AF_UNIX on Linux, without importing socket (every import here is paid per execution)
DROP_FAILED = 121
"""Exit code when the sandbox's process is not unprivileged (the sandbox refuses to run code)."""
SIGPENDING = 64


def check_unprivileged(uid, no_groups):
    """Exit with DROP_FAILED unless this process is ``uid``/``uid`` with no capability (and, if asked, no group) left.

    An ordinary trainer's sandbox keeps that user's own supplementary groups (shown as 65534 inside),
    as bubblewrap leaves them; a root trainer's has none (``setpriv --clear-groups``).
    """
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        ids = status["Uid"].split() + status["Gid"].split()
        caps = [int(status[k], 16) for k in ("CapPrm", "CapEff", "CapAmb")]
        if any(int(i) != uid for i in ids) or any(caps) or (no_groups and os.getgroups()):
            raise PermissionError(f"ids {ids}, capabilities {caps}, groups {os.getgroups()}")
    except (OSError, KeyError, ValueError) as exc:
        sys.stderr.write(f"sandbox: not an unprivileged process: {exc}\n")
        sys.stderr.flush()
        os._exit(DROP_FAILED)


def set_limits(cfg):
    mb = 1024 * 1024
    pairs = [
        (resource.RLIMIT_CPU, (cfg["cpu_time_s"], cfg["cpu_time_s"] + 1)),  # soft: SIGXCPU, hard: SIGKILL
        (resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (int(cfg["max_file_mb"] * mb),) * 2),
        (resource.RLIMIT_NOFILE, (cfg["max_open_files"],) * 2),
        # Counts this process too; per execution under a root trainer (each has its own uid). Root is exempt.
        (resource.RLIMIT_NPROC, (cfg["max_processes"] + 1,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_MEMLOCK, (0, 0)),
        (resource.RLIMIT_MSGQUEUE, (0, 0)),
        (resource.RLIMIT_SIGPENDING, (SIGPENDING, SIGPENDING)),
    ]
    for which, (soft, hard) in pairs:
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:  # never ask for more than we already may have
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))


def isolate_network():
    """Best effort, unsafe mode only: an empty network namespace if the kernel grants one."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
            if libc.unshare(flags) == 0:
                return
    except Exception:  # noqa: BLE001 -- no ctypes / no unshare: the hook still refuses sockets
        pass


def make_hook(workdir, read_roots):
    """The hook; every table it consults is bound here, so editing this module's globals changes nothing."""
    busy = set()  # thread ids inside the hook: events its own work raises are not checked again
    get_ident = _thread.get_ident
    sep = os.sep
    blocked_events, blocked_prefixes = BLOCKED_EVENTS, BLOCKED_PREFIXES
    path_events, write_flags, af_unix = dict(PATH_EVENTS), WRITE_FLAGS, AF_UNIX
    allowed_native = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"})

    def inside(path, roots):
        return any(path == r or path.startswith(r + sep) for r in roots)

    def check_path(raw, write):
        if isinstance(raw, int) or raw is None:
            return  # an already-open descriptor or "current directory" default
        try:
            path = os.path.realpath(os.fsdecode(os.fspath(raw)))
        except (TypeError, ValueError):
            return
        if inside(path, (workdir,)):
            return
        if path == "/dev/null" or (not write and (path in ("/dev/urandom", "/dev/zero") or inside(path, read_roots))):
            return
        raise PermissionError(f"sandbox: access to {os.fsdecode(os.fspath(raw))!r} is blocked: code may only use its working directory")

    def hook(event, args):
        me = get_ident()
        if me in busy:
            return  # events raised by the hook's own work (realpath)
        busy.add(me)
        try:
            if event == "open":
                path, mode, flags = (list(args) + [None, None])[:3]
                write = bool(isinstance(flags, int) and flags & write_flags) or bool(
                    isinstance(mode, str) and any(c in mode for c in "wax+")
                )
                check_path(path, write)
            elif event in path_events:
                indices, write = path_events[event]
                for i in indices:
                    if i < len(args):
                        check_path(args[i], write)
            elif event.startswith("socket."):
                if event == "socket.__new__" and len(args) > 1 and args[1] == af_unix:
                    return  # local socketpairs (asyncio's self-pipe); connect/bind stay blocked
                raise PermissionError(f"sandbox: network access is blocked ({event})")
            elif event in allowed_native:
                return  # loading a library (``import ctypes``, numpy) is harmless; calling into it is not
            elif event in blocked_events or event.startswith(blocked_prefixes):
                raise PermissionError(f"sandbox: {event} is blocked (no new processes, signals or native calls)")
        finally:
            busy.discard(me)

    return hook


def hide_own_frames(report, seen=None):
    """Drop this bootstrap's frames (the exec call, the audit hook) from a traceback, chained ones too."""
    seen = set() if seen is None else seen
    if report is None or id(report) in seen:
        return
    seen.add(id(report))
    import traceback

    here = os.path.realpath(__file__)
    frames = [f for f in report.stack if os.path.realpath(f.filename) != here]
    report.stack = traceback.StackSummary.from_list(frames)
    hide_own_frames(report.__cause__, seen)
    hide_own_frames(report.__context__, seen)


def read_roots(extra):
    roots = set()
    for entry in list(sys.path) + [sys.prefix, sys.base_prefix, sys.exec_prefix] + list(extra):
        if entry and os.path.exists(entry):
            roots.add(os.path.realpath(entry))
    return tuple(sorted(roots))


def show_source(code):
    """Let tracebacks show the code's lines without reading any file."""
    import linecache

    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")


def main():
    cfg = json.loads(sys.argv[1])
    if cfg.get("expect_uid") is not None:
        check_unprivileged(cfg["expect_uid"], cfg["expect_no_groups"])
    workdir = os.path.realpath(os.getcwd())
    roots = read_roots(cfg["extra_read_paths"])
    code = sys.stdin.buffer.read().decode("utf-8", errors="replace")  # a warm worker waits here
    sys.stdin.close()
    set_limits(cfg)
    if cfg.get("isolate_network"):
        isolate_network()
    try:
        compiled = compile(code, "<code>", "exec")
    except (SyntaxError, ValueError) as exc:
        import traceback

        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        sys.exit(1)
    except MemoryError:
        sys.stderr.write("MemoryError: the code is too large to compile within memory_mb\n")
        sys.exit(1)
    sys.addaudithook(make_hook(workdir, roots))
    del sys.argv[1:]
    module = type(sys)("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    try:
        exec(compiled, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 -- report like the interpreter would
        import traceback

        show_source(code)
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        hide_own_frames(report)
        sys.stderr.write("".join(report.format()))
        sys.exit(1)


if __name__ == "__main__":
    main()
