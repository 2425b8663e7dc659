"""A bubblewrap sandbox for a whole command, one per sample: an agent harness that runs model-written shell commands.

The code tool's sandbox (:mod:`.sandbox`) runs one snippet of Python on a tmpfs. A coding harness (Claude Code,
Codex CLI, Qwen Code, opencode: Node programs) needs more of a machine: a repository to work in, a HOME for its
config and cache, a shell and the system's tools, processes and threads, and its model's endpoint. A
:class:`CommandSandbox` gives each sample that, built from the same parts (:mod:`.bwrap`'s namespaces and device
list, :mod:`.host_user`'s unprivileged uid, :mod:`.memory_cgroup`, :mod:`.seccomp`, :mod:`.sandbox_worker`'s spawn
and kill), and nothing else of the host. What the command sees:

* ``/workspace`` (its working directory, ``$MCORE_AGENTIC_WORKDIR``): read-write, a per-sample copy of the task's
  directory made on the host (or empty); ``/home/agent`` (``$HOME``): read-write, per sample, empty at start;
* ``/tmp`` (``$TMPDIR``): a tmpfs of ``disk_mb``; ``/dev`` bwrap's own (the usual devices and a devpts of the
  sandbox's own: shell tools run commands under a pseudo-terminal), read-only, with a 64 MiB ``/dev/shm``;
* read-only: ``/usr``, the system's ``/bin``, ``/sbin`` and library directories, the trainer's Python (the
  bootstrap's interpreter), a few ``/etc`` files (:data:`ETC_FILES`: users and groups, the loader's cache,
  certificates, time zone, ``alternatives``; a ``hosts`` of ``localhost`` only, no ``resolv.conf``), the row as JSON
  (``$MCORE_AGENTIC_ROW``) and ``extra_read_paths`` (the harness's install directory);
* a network namespace of its own with only loopback: ``127.0.0.1:`` :data:`FORWARD_PORT` is a forwarder
  (:mod:`.command_sandbox_child`) to the endpoint's Unix socket, bound in from the host; nothing else answers;
* uid/gid 65534 (``agent``), no capabilities; on the host an unprivileged uid (a dedicated one, leased for the
  sample's life, under a root trainer); the limits of ``memory_mb`` (the sample's RAM with ``disk_mb``: a memory
  cgroup, required unless ``memory_cgroup`` says otherwise), ``address_space_mb`` (per process; none by default:
  V8 reserves ~10 GB per WebAssembly instance), ``max_processes``, ``max_open_files``,
  ``max_file_mb``; the seccomp
  filter of the code sandbox with processes allowed (no new namespaces), and file locks and ``inotify``
  (:data:`SHARED_FILE_ALLOWED`).

On the host a sample is one directory ``s<N>`` (``work/``, ``home/``, ``row.json``) under this process's state
directory, ``<sample_dirs or the temporary directory>/mcore_agentic_agent.<owner tag>.<random>``, which also holds
the endpoint's socket (or, when that path would be too long for a socket, a second such directory in the temporary
directory does). The trainer's uid owns them, mode 0700. :meth:`CommandSandbox.release` removes a sample's directory; :meth:`CommandSandbox.close`
kills every running sample and removes the state directory; a later trainer removes the directory of one that was
killed first (:mod:`.owner`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mcore_agentic.tools.bwrap import (
    _NAMESPACES,
    SANDBOX_UID,
    SETPRIV_PATH,
    SandboxUnavailable,
    _mount_point_parents,
    describe_failure,
    find_bwrap,
    interpreter_image,
)
from mcore_agentic.tools.host_user import HostUser, HostUserError, resolve_host_user
from mcore_agentic.tools.memory_cgroup import MemoryCgroups
from mcore_agentic.tools.owner import OwnerTag, stale_entries
from mcore_agentic.tools.sandbox_child import DROP_FAILED
from mcore_agentic.tools.sandbox_worker import SpawnPlan, Worker
from mcore_agentic.tools.seccomp import build_filter
from mcore_agentic.utils.errors import ConfigError

logger = logging.getLogger(__name__)

WORKSPACE = "/workspace"
HOME = "/home/agent"
RUN_DIR = "/run/mcore_agentic"
SOCKET = f"{RUN_DIR}/endpoint.sock"
ROW_FILE = f"{RUN_DIR}/row.json"
CHILD = f"{RUN_DIR}/command_sandbox_child.py"
FORWARD_PORT = 18080
"""The forwarder's port on the sandbox's own loopback."""
FORWARD_URL = f"http://127.0.0.1:{FORWARD_PORT}"
USER = "agent"
STATE_PREFIX = "mcore_agentic_agent"
ETC_FILES = (
    "/etc/nsswitch.conf", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/timezone", "/etc/alternatives", "/etc/ssl", "/etc/ca-certificates", "/etc/ca-certificates.conf", "/etc/pki",
    "/etc/crypto-policies", "/etc/os-release", "/etc/lsb-release", "/etc/debian_version", "/etc/mime.types",
    "/etc/protocols", "/etc/services", "/etc/bash.bashrc", "/etc/profile", "/etc/inputrc", "/etc/terminfo",
    "/etc/gitconfig", "/etc/magic", "/etc/manpath.config",
)  # fmt: skip
"""``/etc`` entries bound read-only where the host has them (``passwd``, ``group`` and ``hosts`` are the sandbox's own)."""
SHARED_FILE_ALLOWED = ("flock", "fcntl_getlk", "inotify_init", "inotify_init1", "inotify_add_watch")
"""Calls the code sandbox denies as ways to observe the files executions share, which toolchains need (Codex CLI
will not start without ``flock``, nor opencode's SQLite in WAL mode without ``F_GETLK``; git, npm and pip lock; file
watchers use inotify). A sample could see another's use of the shared read-only files through them; that is all
they give."""
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Bound read-only (or recreated as the host's symlinks into ``/usr``), beside ``/usr``."""
_MB = 1 << 20
_OUTPUT_WINDOW = 1 << 20
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating zero


class CommandLimits(Protocol):
    """What a :class:`CommandSandbox` reads of its config (``rollout.agent.sandbox_limits``)."""

    memory_mb: int
    address_space_mb: int | None
    disk_mb: int
    max_file_mb: float
    max_open_files: int
    max_processes: int
    extra_read_paths: tuple[str, ...]
    bwrap_path: str | None
    host_user: str
    host_uid_range: tuple[int, int] | None
    memory_cgroup: str


@dataclass
class Ran:
    """What one run of a command in a sample's sandbox did."""

    stdout: str
    """The last MiB of its stdout (its first MiB too when it printed less than two)."""
    stderr: str
    returncode: int | None
    """None when it was stopped (timeout, output cap, :meth:`SampleDir.kill`)."""
    timed_out: bool = False
    output_exceeded: bool = False
    killed: bool = False


@dataclass(eq=False)
class SampleDir:
    """One sample's host-side state: its directories and the host uid its processes run as."""

    root: Path
    work: Path
    home: Path
    row: Path
    uid: int
    lease_fd: int | None
    number: int
    _worker: Worker | None = None
    _killed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def kill(self) -> None:
        """Kill what runs in this sample's sandbox now, and refuse to start more (from any thread)."""
        with self._lock:
            self._killed = True
            worker = self._worker
        if worker is not None:
            worker.kill()


def _visible_fix(message: str) -> str:
    """The code tool's fix hints, in this config's words."""
    for tail in (", or set the code tool's config sandbox: unsafe_subprocess to run model code without isolation",
                 "; or set sandbox: unsafe_subprocess to run model code without isolation",
                 ", or set sandbox: unsafe_subprocess to run model code without isolation",
                 " or set sandbox: unsafe_subprocess to run model code without isolation"):
        if message.endswith(tail):
            message = message[: -len(tail)] + ", or set rollout.agent.sandbox=none (the command then runs on the host)"
            break
    prefix = "rollout.agent.sandbox_limits."
    for key in ("host_user: trainer", "host_uid_range", "bwrap_path", "extra_read_paths"):
        message = message.replace(key, prefix + key.replace(": ", "="))
    return message


class CommandSandbox:
    """Runs commands in per-sample bubblewrap sandboxes (module docstring); thread-safe."""

    def __init__(self, limits: CommandLimits, *, sample_dirs: str | None = None):
        self.limits = limits
        self._lock = threading.Lock()
        self._samples: set[SampleDir] = set()
        self._numbers = itertools.count()
        self._runs = itertools.count()
        self._cgroups: MemoryCgroups | None = None
        self._closed = False
        self.state_dir = _state_dir(sample_dirs)
        self._socket_dir: Path | None = None
        self.socket_path = str(self.state_dir / "endpoint.sock")
        """Where the endpoint should listen too; bound into every sample's sandbox."""
        try:
            if len(self.socket_path.encode()) > _MAX_SOCKET_PATH:  # a deep sample_dirs: the socket in the temp dir
                self._socket_dir = _state_dir(None)
                self.socket_path = str(self._socket_dir / "endpoint.sock")
            if len(self.socket_path.encode()) > _MAX_SOCKET_PATH:
                raise SandboxUnavailable(f"the endpoint's socket path {self.socket_path} is longer than a Unix socket "
                                         f"path may be ({_MAX_SOCKET_PATH} bytes); set TMPDIR to a shorter directory")
            self._bwrap = find_bwrap(limits.bwrap_path)
            uid_range = tuple(limits.host_uid_range) if limits.host_uid_range is not None else None
            self._host_user: HostUser = resolve_host_user(limits.host_user, uid_range)  # type: ignore[arg-type]
            self._use_memory_cgroup()
            self._seccomp = build_filter(allow_processes=True, deny_unbounded_ram=self._cgroups is None,
                                         allow=SHARED_FILE_ALLOWED)
            if self._seccomp is None:
                raise SandboxUnavailable("the sandbox's seccomp filter is described for x86-64 and aarch64 only; run on "
                                         "one of them, or set rollout.agent.sandbox=none")
            self._binds, self._symlinks = self._system_image()
            self._write_identity()
            self._probe()
        except (SandboxUnavailable, HostUserError) as exc:
            self.close()
            raise ConfigError("rollout.agent.sandbox", _visible_fix(str(exc))) from None
        except BaseException:
            self.close()
            raise

    # -- set-up --------------------------------------------------------------------------------------

    def _use_memory_cgroup(self) -> None:
        from mcore_agentic.tools.sandbox import _process_cgroups

        if self.limits.memory_cgroup == "off":
            logger.warning("agent sandbox: memory_cgroup=off: each process's address space (%s) is the only memory bound",
                           f"{self.limits.address_space_mb} MB" if self.limits.address_space_mb else "unbounded")
            return
        self._cgroups, where = _process_cgroups()
        if self._cgroups is None and self.limits.memory_cgroup == "required":
            raise SandboxUnavailable(
                f"rollout.agent.sandbox_limits.memory_cgroup=required, but no memory cgroup can be created here "
                f"({where}); run the trainer as root on a host with cgroups, delegate a cgroup v2 subtree to its user, "
                "or set it to auto with address_space_mb (a per-process bound: Node harnesses need >= 32768)")
        if self._cgroups is None:
            logger.warning("agent sandbox: no memory cgroup (%s): each process's address space (%s) is the only memory "
                           "bound; memfd and System V IPC are denied", where,
                           f"{self.limits.address_space_mb} MB" if self.limits.address_space_mb else "unbounded")

    def _system_image(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Read-only (host source, sandbox path) binds and (target, path) symlinks every sample's sandbox has."""
        binds: dict[str, str] = {}  # sandbox path -> host source
        symlinks: list[tuple[str, str]] = []
        if os.path.isdir("/usr"):
            binds["/usr"] = "/usr"
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                symlinks.append((os.readlink(d), d))
            elif os.path.isdir(d):
                binds[d] = d
        system = list(binds)
        for src, dst in interpreter_image(site_packages=False).binds:  # the bootstrap's interpreter, unless /usr has it
            if not (src == dst and any(_under(dst, root) for root in system)):
                binds[dst] = src
        for path in ETC_FILES:
            if os.path.exists(path):
                binds[path] = os.path.realpath(path)
        for path in self.limits.extra_read_paths:
            if not os.path.exists(path):
                raise SandboxUnavailable(f"extra_read_paths {path!r} does not exist; list existing paths only")
            binds[os.path.abspath(path)] = os.path.realpath(path)
        here = Path(__file__).parent
        binds[CHILD] = str(here / "command_sandbox_child.py")
        binds[f"{RUN_DIR}/sandbox_child.py"] = str(here / "sandbox_child.py")
        return sorted(((src, dst) for dst, src in binds.items()), key=lambda sd: sd[1]), symlinks

    def _write_identity(self) -> None:
        """The sandbox's own ``/etc/passwd``, ``group`` and ``hosts`` (in the state directory, bound read-only)."""
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        files = {
            "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\n{USER}:x:{SANDBOX_UID}:{SANDBOX_UID}:{USER}:{HOME}:{shell}\n",
            "group": f"root:x:0:\n{USER}:x:{SANDBOX_UID}:\n",
            "hosts": "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n",
        }
        for name, text in files.items():
            path = self.state_dir / name
            path.write_text(text)
            path.chmod(0o644)
            self._binds.append((str(path), f"/etc/{name}"))
        self.shell = shell

    def _probe(self) -> None:
        """One sample through the real path: proves bwrap, the maps, the privilege drop and the limits work here."""
        sample = self.prepare(None, "{}")
        try:
            ran = self.run(sample, [sys.executable, "-I", "-c", "import os; print('probe-ok', os.getuid(), os.getcwd())"],
                           {}, b"", 60.0, endpoint=False)
        except (OSError, RuntimeError) as exc:
            raise SandboxUnavailable(f"could not set up the sandbox ({type(exc).__name__}: {exc})") from None
        finally:
            self.release(sample)
        if ran.returncode == DROP_FAILED:
            raise SandboxUnavailable(f"the sandbox did not start unprivileged ({ran.stderr.strip()})")
        if ran.stdout.split() != ["probe-ok", str(SANDBOX_UID), WORKSPACE]:
            raise SandboxUnavailable(describe_failure(ran.stderr, ran.returncode))

    # -- samples -------------------------------------------------------------------------------------

    def visible(self, path: str) -> bool:
        """Whether ``path`` (a host path) is there, at the same path, inside every sample's sandbox: bound itself, or
        under a bound directory with what its links point to there too."""
        path = os.path.abspath(path)
        if any(path == dst for _, dst in self._binds):
            return True
        roots = [dst for _, dst in self._binds] + [p for _, p in self._symlinks]
        return all(any(_under(p, r) for r in roots) for p in (path, os.path.realpath(path)))

    def inside_path(self) -> str:
        """``PATH`` inside: the trainer's ``PATH`` entries the sandbox has, then the system's."""
        dirs = [d for d in os.environ.get("PATH", "").split(":") if d and os.path.isabs(d) and self.visible(d)]
        for d in ("/usr/local/bin", "/usr/bin", "/bin"):
            if d not in dirs:
                dirs.append(d)
        return ":".join(dict.fromkeys(dirs))

    def prepare(self, template: str | None, row_json: str) -> SampleDir:
        """A sample's directories: ``template`` copied into its work directory (or an empty one), an empty HOME, the
        row; owned by the uid the sample will run as."""
        n = next(self._numbers)
        root = self.state_dir / f"s{n}"
        root.mkdir(mode=0o700)
        sample = SampleDir(root=root, work=root / "work", home=root / "home", row=root / "row.json", uid=-1,
                           lease_fd=None, number=n)
        with self._lock:
            self._samples.add(sample)
        try:
            if template is not None:
                shutil.copytree(template, sample.work, symlinks=True)
            else:
                sample.work.mkdir(mode=0o755)
            sample.home.mkdir(mode=0o700)
            sample.row.write_text(row_json)
            sample.row.chmod(0o644)
            sample.uid, sample.lease_fd = self._host_user.lease_uid(n)
            if self._host_user.drops_root:  # a dedicated uid: it owns its directories (bwrap binds them as they are)
                for top in (sample.work, sample.home):
                    _chown_tree(top, sample.uid)
        except BaseException:
            self.release(sample)
            raise
        return sample

    def run(self, sample: SampleDir, argv: list[str], env: dict[str, str], stdin: bytes, timeout_s: float, *,
            endpoint: bool = True) -> Ran:
        """Run ``argv`` in a fresh sandbox over ``sample``'s directories (blocking) and collect its output; the
        sandbox and everything it started are gone when this returns. ``env`` adds to the sandbox's own environment."""
        limits = self.limits
        host_user = self._host_user
        settings = {
            "expect_uid": SANDBOX_UID,
            "expect_no_groups": host_user.drops_root,
            "address_space_mb": limits.address_space_mb,
            "max_file_mb": limits.max_file_mb,
            "max_open_files": limits.max_open_files,
            "max_processes": limits.max_processes if host_user.drops_root else None,
            "socket": SOCKET if endpoint else None,
            "port": FORWARD_PORT,
        }
        command = [sys.executable, "-I", "-B", CHILD, json.dumps(settings), *argv]
        binds = [*self._binds, (str(sample.row), ROW_FILE)]
        if endpoint:
            binds.append((self.socket_path, SOCKET))

        def prefix(seccomp_fd: int, info_fd: int, block_fd: int) -> list[str]:
            return command_argv(self._bwrap, binds, self._symlinks, [(str(sample.work), WORKSPACE),
                                (str(sample.home), HOME)], limits.disk_mb, seccomp_fd=seccomp_fd, info_fd=info_fd,
                                userns_block_fd=block_fd, setpriv=host_user.setpriv)

        inside = {"PATH": self.inside_path(), "HOME": HOME, "TMPDIR": "/tmp", "USER": USER, "LOGNAME": USER,
                  "SHELL": self.shell, "LANG": "C.UTF-8", "TERM": "dumb", "MCORE_AGENTIC_WORKDIR": WORKSPACE,
                  "MCORE_AGENTIC_ROW": ROW_FILE, **env}
        plan = SpawnPlan(
            command, inside, "/", bwrap_prefix=prefix, seccomp=self._seccomp, maps=host_user.maps(sample.uid),
            lease_fd=os.dup(sample.lease_fd) if sample.lease_fd is not None else None,
            deny_setgroups=not host_user.drops_root, cgroup_limit=(limits.memory_mb + limits.disk_mb) * _MB,
            cgroup_name=f"agent{next(self._runs)}",
        )  # fmt: skip (the environment goes to bwrap's own, never its argv: other users can read a process's argv)
        with sample._lock:
            if sample._killed or self._closed:
                if plan.lease_fd is not None:
                    os.close(plan.lease_fd)
                return Ran("", "", None, killed=True)
            worker = sample._worker = Worker.spawn(plan, self._cgroups)
        try:
            worker.send(stdin)
            seen = worker.collect(timeout_s, _OUTPUT_WINDOW, int(limits.max_file_mb * _MB))
            rc = worker.proc.returncode
        finally:
            worker.close(self._cgroups)
            with sample._lock:
                sample._worker = None
                killed = sample._killed
        stdout, _ = seen.stdout.text(2 * _OUTPUT_WINDOW)
        stderr, _ = seen.stderr.text(2 * _OUTPUT_WINDOW)
        stopped = seen.timed_out or seen.output_exceeded or killed
        return Ran(stdout, stderr, None if stopped else rc, timed_out=seen.timed_out,
                   output_exceeded=seen.output_exceeded, killed=killed and not seen.timed_out)

    def release(self, sample: SampleDir) -> None:
        """Kill what still runs in ``sample``, remove its directories, give back its uid."""
        sample.kill()
        _remove_tree(sample.root)
        if sample.lease_fd is not None:
            with contextlib.suppress(OSError):
                os.close(sample.lease_fd)
            sample.lease_fd = None
        with self._lock:
            self._samples.discard(sample)

    def close(self) -> None:
        """Kill every running sample and remove the state directory (the endpoint's socket with it); idempotent."""
        with self._lock:
            self._closed = True
            samples = list(self._samples)
        for sample in samples:
            self.release(sample)
        _remove_tree(self.state_dir)
        if self._socket_dir is not None:
            _remove_tree(self._socket_dir)


_SHM_MB = 64
"""Size of the sandbox's ``/dev/shm`` tmpfs."""


def command_argv(bwrap: str, binds: list[tuple[str, str]], symlinks: list[tuple[str, str]],
                 writable: list[tuple[str, str]], disk_mb: int, *, seccomp_fd: int, info_fd: int, userns_block_fd: int,
                 setpriv: str | None) -> list[str]:
    """``bwrap`` and its options up to ``--`` (and the privilege drop) for one sample; append the command.

    As the code sandbox's (:func:`.bwrap.bwrap_argv`): new namespaces, bwrap waiting for the maps, ``/proc`` and
    ``/dev`` read-only, capabilities dropped, ``setpriv`` under a root trainer. Then a size-capped ``/tmp``, the
    read-only ``binds``, the read-write ``writable`` binds, the root remounted read-only. The environment is not
    in the argv (bwrap passes its own on)."""
    argv = [bwrap, *_NAMESPACES, "--userns-block-fd", str(userns_block_fd), "--info-fd", str(info_fd)]
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if setpriv is not None:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    # bwrap's own /dev: null, zero, full, random, urandom, tty and a devpts instance of the sandbox's own (a harness's
    # shell tool runs commands under a pseudo-terminal: Qwen Code's forkpty), read-only once built; /dev/shm a small
    # tmpfs (the memory cgroup counts it with the rest).
    argv += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]
    argv += ["--size", str(_SHM_MB * _MB), "--perms", "1777", "--tmpfs", "/dev/shm"]
    argv += ["--size", str(disk_mb * _MB), "--perms", "1777", "--tmpfs", "/tmp"]
    for target, path in symlinks:
        argv += ["--symlink", target, path]
    all_binds = [*binds, *writable] + ([(setpriv, SETPRIV_PATH)] if setpriv is not None else [])
    for parent in _mount_point_parents([dst for _, dst in all_binds]):
        if parent != "/tmp":
            argv += ["--perms", "0755", "--dir", parent]
    for src, dst in binds:
        argv += ["--ro-bind", src, dst]
    if setpriv is not None:
        argv += ["--ro-bind", setpriv, SETPRIV_PATH]
    for src, dst in writable:
        argv += ["--bind", src, dst]
    argv += ["--chdir", WORKSPACE, "--remount-ro", "/dev", "--remount-ro", "/"]
    argv += ["--seccomp", str(seccomp_fd), "--"]
    if setpriv is not None:
        ids = str(SANDBOX_UID)
        argv += [SETPRIV_PATH, f"--reuid={ids}", f"--regid={ids}", "--clear-groups"]
        argv += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    return argv


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _chown_tree(top: Path, uid: int) -> None:
    """``top`` and everything under it owned by ``uid`` (links themselves, never what they point to)."""
    os.lchown(top, uid, uid)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def _remove_tree(path: Path) -> None:
    """Remove ``path`` whatever the sample did to its modes (an ordinary trainer's sandbox owns its files)."""

    def retry(func: Any, failed: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            parent = os.path.dirname(failed)
            os.chmod(parent, stat.S_IRWXU)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, stat.S_IRWXU)
            func(failed)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)


def _state_dir(sample_dirs: str | None) -> Path:
    """This process's new state directory (``mkdtemp``: private, 0700); those of trainers that are gone removed."""
    base = Path(sample_dirs or tempfile.gettempdir())
    for entry in stale_entries(base, STATE_PREFIX):
        if entry.is_dir() and not entry.is_symlink() and entry.lstat().st_uid == os.geteuid():
            _remove_tree(entry)
            logger.info("agent sandbox: removed the sample directories of a trainer that is gone (%s)", entry)
    return Path(tempfile.mkdtemp(prefix=f"{STATE_PREFIX}.{OwnerTag.this_process()}.", dir=base))
