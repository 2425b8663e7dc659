"""What the code sandbox leaves of the host untouched, checked from the host, for attacks sent as a model would send them.

Each test sends its attack through the code tool's public path (Hermes text -> parser -> schema check ->
``safe_execute``, :func:`model_call`) with the audit hook switched off first (``attack``), and then looks at
the *host*: a process's uid in ``/proc/<pid>/status``, a sysctl's value, free disk and memory, file locks,
what is left in the cgroup hierarchy and the temporary directory after the trainer is gone. Every test
runs as whatever user runs the suite (CI: root, where the guarantees are hardest to keep); the few that
only mean something for a root trainer skip otherwise.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from mcore_agentic.tools.bwrap import BOOTSTRAP_PATH
from mcore_agentic.tools.host_user import DEFAULT_UID_RANGE, HostUserError, pick_uid_range, resolve_host_user
from mcore_agentic.tools.memory_cgroup import PREFIX, MemoryCgroups, _mounts, _own_paths, _v2_parents
from mcore_agentic.tools.owner import OwnerTag
from mcore_agentic.tools.sandbox import get_sandbox
from tests.unit.tools.test_sandbox_escapes import attack, make_tool, model_call

ROOT = Path(__file__).resolve().parents[3]
AS_ROOT = os.geteuid() == 0
MB = 1 << 20


@pytest.fixture(scope="module")
def tool():
    return make_tool(warm_pool=1)


@pytest.fixture(scope="module")
def forking_tool():
    return make_tool(max_processes=4, timeout_s=5)


def _bootstrap_processes() -> dict[int, dict[str, str]]:
    """Host view (``/proc/<pid>/status``) of every sandboxed interpreter: argv names the bootstrap, argv[0] is not bwrap."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if BOOTSTRAP_PATH.encode() not in argv or b"bwrap" in argv[0]:
                continue
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found[int(pid)] = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return found


def _in_background(fn, *args):
    box: dict = {}

    def run():
        box["result"] = fn(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# -- 1. unprivileged on the host -----------------------------------------------------------------------


def test_sandboxed_processes_are_an_unprivileged_host_uid(forking_tool):
    """From outside: every sandboxed interpreter (and what it forks) has no uid/gid 0, no groups, no capabilities."""
    code = attack(
        """
        import time
        if unhooked(os.fork) == 0:
            time.sleep(2)
            os._exit(0)
        time.sleep(2)
        """
    )
    calls = [_in_background(model_call, forking_tool, code) for _ in range(2)]
    seen: dict[int, dict[str, str]] = {}
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        seen.update(_bootstrap_processes())
        time.sleep(0.05)
    for thread, _ in calls:
        thread.join()
    assert len(seen) >= 4, seen.keys()  # two executions, each with a forked child (and warm workers)
    uids = set()
    for pid, status in seen.items():
        ids = status["Uid"].split() + status["Gid"].split()
        assert "0" not in ids, (pid, status["Uid"], status["Gid"])
        groups = {int(g) for g in status["Groups"].split()}
        assert groups == set() if AS_ROOT else groups <= set(os.getgroups()), (pid, status["Groups"])  # never group 0
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapAmb"], 16) == 0
        uids.add(int(status["Uid"].split()[0]))
    if AS_ROOT:  # dedicated uids, one per execution
        first, count = get_sandbox(forking_tool.limits)._host_user.uid_range
        assert all(first <= uid < first + count for uid in uids), uids
        assert len(uids) >= 2, uids
    else:
        assert uids == {os.geteuid()}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def test_kernel_tunables_stay_as_they_are(tool):
    targets = {
        "/proc/sys/kernel/core_pattern": "|/bin/sh -c 'touch /tmp/mcore-pwned' %p",
        "/proc/sys/vm/overcommit_ratio": "77",
        "/proc/sys/fs/pipe-max-size": "4096",
        "/proc/sys/kernel/printk_ratelimit": "17",
        "/proc/sysrq-trigger": "h",
    }
    before = {path: _read(path) for path in targets}
    code = attack(
        f"""
        def poke():
            wrote = {{}}
            for path, value in {targets!r}.items():
                try:
                    with open(path, "w") as f:
                        f.write(value)
                    wrote[path] = "WROTE"
                except OSError as exc:
                    wrote[path] = exc.errno
            return wrote
        print(unhooked(poke))
        """
    )
    try:
        result = model_call(tool, code)
        after = {path: _read(path) for path in targets}
    finally:
        for path, value in before.items():
            if value is not None and _read(path) != value and path.startswith("/proc/sys/"):
                Path(path).write_text(value)  # undo a successful attack before failing
    assert after == before
    assert "WROTE" not in result.text, result.text


@pytest.mark.skipif(not AS_ROOT, reason="a root-only file means something only to a root trainer")
def test_root_only_files_in_extra_read_paths_stay_unreadable(tmp_path):
    shared = tmp_path / "shared"
    (shared / "private").mkdir(parents=True)
    for path in (tmp_path, shared):
        path.chmod(0o755)
    (shared / "public.txt").write_text("PUBLIC")
    (shared / "public.txt").chmod(0o644)
    token = f"ROOTONLY-{uuid.uuid4().hex}"
    (shared / "secret.txt").write_text(token)
    (shared / "secret.txt").chmod(0o600)
    (shared / "private").chmod(0o700)
    (shared / "private" / "note.txt").write_text(token)
    tool = make_tool(extra_read_paths=[str(shared)], warm_pool=0)
    code = attack(
        f"""
        def read():
            got = {{}}
            for name in ("public.txt", "secret.txt", "private/note.txt"):
                try:
                    got[name] = open(os.path.join({str(shared)!r}, name)).read()
                except OSError as exc:
                    got[name] = exc.errno
            return got
        print(unhooked(read))
        """
    )
    result = model_call(tool, code)
    assert token not in result.text
    assert eval(result.text) == {"public.txt": "PUBLIC", "secret.txt": 13, "private/note.txt": 13}  # noqa: S307 -- EACCES


def test_the_trainers_per_user_kernel_limits_stay_available(tool):
    """inotify instances are counted per user (and up the user namespaces to their owner): the code gets none."""
    code = attack(
        """
        import ctypes
        def exhaust():
            libc = ctypes.CDLL(None, use_errno=True)
            made = 0
            while made < 10000 and libc.inotify_init1(0) >= 0:
                made += 1
            return made, ctypes.get_errno()
        print(unhooked(exhaust))
        """
    )
    result = model_call(tool, code)
    assert eval(result.text) == (0, 1), result.text  # noqa: S307 -- (none made, EPERM)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    assert fd >= 0, ctypes.get_errno()
    os.close(fd)


def test_the_process_count_binds_even_under_a_root_trainer(forking_tool):
    code = attack(
        """
        import time
        def spawn():
            started = 0
            for _ in range(20):
                try:
                    if os.fork() == 0:
                        time.sleep(2)
                        os._exit(0)
                    started += 1
                except OSError:
                    pass
            return started
        print(unhooked(spawn))
        """
    )
    result = model_call(forking_tool, code)
    started = int(result.text.split()[0])
    assert 1 <= started <= 4, result.text  # max_processes: 4


# -- 2. every byte bounded ---------------------------------------------------------------------------------


def test_output_descriptors_are_pipes_that_reach_no_host_file(tool):
    before = os.statvfs(tempfile.gettempdir())
    entries_before = set(os.listdir(tempfile.gettempdir()))
    code = attack(
        """
        def abuse():
            seen = {}
            for fd in (1, 2):
                seen[f"link{fd}"] = os.readlink(f"/proc/self/fd/{fd}").split(":")[0]
                for name, fn in (
                    ("fallocate", lambda: os.posix_fallocate(fd, 0, 8 << 30)),
                    ("truncate", lambda: os.ftruncate(fd, 8 << 30)),
                    ("xattr", lambda: os.setxattr(fd, "user.mcore", b"x")),
                ):
                    try:
                        fn()
                        seen[f"{name}{fd}"] = "OK"
                    except OSError as exc:
                        seen[f"{name}{fd}"] = exc.errno
            for name, fn in (("tmpfs", lambda: os.posix_fallocate(os.open("big", os.O_CREAT | os.O_WRONLY), 0, 8 << 30)),):
                try:
                    fn()
                    seen[name] = "OK"
                except OSError as exc:
                    seen[name] = exc.errno
            return seen
        print(unhooked(abuse))
        """
    )
    result = model_call(tool, code)
    after = os.statvfs(tempfile.gettempdir())
    seen = eval(result.text)  # noqa: S307 -- our own repr
    assert seen["link1"] == seen["link2"] == "pipe"
    assert "OK" not in seen.values(), seen
    freed_mb = (before.f_bavail - after.f_bavail) * before.f_frsize / MB
    assert freed_mb < 256, freed_mb  # nothing near the 8 GB asked for
    new = {e for e in set(os.listdir(tempfile.gettempdir())) - entries_before if e.startswith("mcore_agentic_sandbox")}
    assert new == set()  # an execution keeps nothing in the host's temporary directory


def _used_mb() -> float:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) / 1024


PIN_RAM = """
import ctypes, fcntl, time
MB = 1 << 20
pinned = {"memfd": 0, "shm": 0, "sem": 0, "tmpfs": 0, "pipes": 0}
keep = []
def memfd():
    for i in range(64):
        fd = os.memfd_create(f"m{i}")
        keep.append(fd)
        for _ in range(16):
            os.write(fd, b"\\1" * MB)
        pinned["memfd"] += 16
def shm():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    for _ in range(32):
        sid = libc.shmget(0, 64 * MB, 0o1600)
        if sid < 0:
            raise OSError(ctypes.get_errno(), "shmget")
        addr = libc.shmat(sid, None, 0)
        ctypes.memset(addr, 1, 64 * MB)
        libc.shmdt(ctypes.c_void_p(addr))
        pinned["shm"] += 64
def sem():
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(200):
        if libc.semget(0, 32000, 0o1600) < 0:  # IPC_PRIVATE, 32000 semaphores, IPC_CREAT | 0600
            raise OSError(ctypes.get_errno(), "semget")
        pinned["sem"] += 2  # about 2 MB of kernel memory a set
def tmpfs():
    for i in range(1024):
        with open(f"fill{i}", "wb") as f:
            f.write(b"\\1" * MB)
        pinned["tmpfs"] += 1
def pipes():
    for _ in range(100):
        r, w = os.pipe()
        keep.extend((r, w))
        fcntl.fcntl(w, 1031, MB)  # F_SETPIPE_SZ
        os.set_blocking(w, False)
        os.write(w, b"\\1" * MB)
        pinned["pipes"] += 1
for route in (memfd, shm, sem, tmpfs, pipes):
    try:
        unhooked(route)
    except OSError as exc:
        print(route.__name__, "refused:", exc.errno, flush=True)
print("pinned", pinned, flush=True)
time.sleep(1)
"""


@pytest.mark.parametrize("memory_cgroup", ["auto", "off"])
def test_ram_pinned_outside_the_address_space_stays_within_the_caps(memory_cgroup):
    tool = make_tool(memory_cgroup=memory_cgroup, memory_mb=256, disk_mb=16, timeout_s=20, warm_pool=0)
    cgroup = get_sandbox(tool.limits).has_memory_cgroup
    assert not cgroup or memory_cgroup == "auto"
    cap_mb = 256 + 16
    time.sleep(0.5)
    idle = _used_mb()
    thread, box = _in_background(model_call, tool, attack(PIN_RAM), 60.0)
    peak = idle
    while thread.is_alive():
        peak = max(peak, _used_mb())
        time.sleep(0.02)
    text = box["result"].text
    assert peak - idle < cap_mb + 128, (peak - idle, text)  # without the bound: > 2 GB (memfd 1 GB + shm 2 GB)
    if not cgroup:  # routes the address-space limit cannot see are refused
        assert "memfd refused: 1" in text and "shm refused: 1" in text and "sem refused: 1" in text, text


# -- 3. nothing left behind -----------------------------------------------------------------------------


HARNESS = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from tests.unit.tools.test_sandbox_escapes import make_tool, model_call
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # as the trainer does at its step boundary
tool = make_tool(**{config!r})
print("READY", flush=True)
model_call(tool, "import time\\nopen('blob', 'wb').write(b'x' * (8 << 20))\\nprint('RUNNING', flush=True)\\ntime.sleep(60)")
"""


def _start_harness(config: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HARNESS.format(root=str(ROOT), config=config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "READY", (line, proc.stderr.read() if proc.poll() is not None else "")
    time.sleep(1.5)  # the execution is under way
    return proc


def _state_of(pid: int) -> list[Path]:
    """Host-side sandbox state named after process ``pid``: cgroup directories and temporary directories."""
    roots = [Path(tempfile.gettempdir())]
    own = _own_paths()
    for point, fstype, options in _mounts():
        if fstype == "cgroup2" and "" in own:
            here = Path(point) / own[""].lstrip("/")
            roots += [here, here.parent]
        elif "memory" in options and "memory" in own:
            roots.append(Path(point) / own["memory"].lstrip("/"))
    found = []
    for root in roots:
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        for entry in entries:
            tag = OwnerTag.parse(entry.name[len(PREFIX) + 1 :]) if entry.name.startswith(PREFIX + ".") else None
            if tag is not None and tag.pid == pid:
                found.append(entry)
    return found


def _bootstrap_pids_of(pid: int) -> list[int]:
    """Sandboxed interpreters whose bwrap is a child of ``pid``."""
    kids = []
    for other in _bootstrap_processes():
        try:
            parent = int(Path(f"/proc/{other}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the ns init
            bwrap = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if int(Path(f"/proc/{bwrap}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(other)
        except (OSError, ValueError, IndexError):
            pass
    return kids


@pytest.mark.parametrize("sandbox", ["bwrap", "unsafe_subprocess"])
def test_a_stopped_trainer_leaves_nothing_behind(sandbox):
    config = {"sandbox": sandbox, "warm_pool": 2, "timeout_s": 5}
    proc = _start_harness(config)
    assert _state_of(proc.pid) or sandbox == "bwrap"  # unsafe mode works in a host directory
    if sandbox == "bwrap":
        assert _bootstrap_pids_of(proc.pid), "the execution and the warm workers should be running"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == 75, proc.stderr.read()
    time.sleep(0.2)
    assert _state_of(proc.pid) == []
    assert _bootstrap_pids_of(proc.pid) == []


@pytest.mark.parametrize("sandbox", ["bwrap", "unsafe_subprocess"])
def test_what_a_killed_trainer_left_is_reclaimed_at_the_next_start(sandbox):
    proc = _start_harness({"sandbox": sandbox, "warm_pool": 1, "timeout_s": 5})
    proc.kill()
    proc.wait()
    time.sleep(0.5)
    left = _state_of(proc.pid)
    if sandbox == "bwrap" and not left:
        pytest.skip("no memory cgroup here: a bwrap sandbox keeps no host-side state at all")
    assert left, "a killed trainer cannot clean up: its state is still there"
    start = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.unit.tools.test_sandbox_escapes import make_tool\n"
        f"make_tool(sandbox={sandbox!r}, warm_pool=0)\n"
    )
    subprocess.run([sys.executable, "-c", start], check=True, timeout=120)  # the next trainer on this host
    assert _state_of(proc.pid) == []


# -- 4. covert channels through shared files -----------------------------------------------------------------


def test_shared_files_carry_no_locks_notifications_or_cache_probes(tool):
    """The read-only interpreter files are shared by every execution: none of these may observe or mark them."""
    shared = os.__file__
    nowait = getattr(os, "RWF_NOWAIT", 8)
    cachestat = 451
    code = attack(
        f"""
        import ctypes, fcntl, mmap, struct, time
        def probe():
            libc = ctypes.CDLL(None, use_errno=True)
            got = {{}}
            f = open({shared!r}, "rb")
            d = os.open(os.path.dirname({shared!r}), os.O_RDONLY)
            m = mmap.mmap(f.fileno(), 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            vec = ctypes.create_string_buffer(1)
            address = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(m)))
            tries = {{
                "flock": lambda: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB),
                "getlk": lambda: fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)),
                "ofd_getlk": lambda: fcntl.fcntl(f, 36, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)),
                "notify": lambda: fcntl.fcntl(d, fcntl.F_NOTIFY, fcntl.DN_ACCESS),
                "preadv2": lambda: os.preadv(f.fileno(), [bytearray(16)], 0, {nowait}),
                "fadvise": lambda: os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED),
                "lease": lambda: fcntl.fcntl(f, fcntl.F_SETLEASE, fcntl.F_RDLCK),
                "pageout": lambda: m.madvise(21),  # MADV_PAGEOUT
                "mincore": lambda: libc.mincore(address, 4096, vec) == 0 or (_ for _ in ()).throw(OSError(ctypes.get_errno(), "mincore")),
                "cachestat": lambda: libc.syscall({cachestat}, f.fileno(), None, None, 0) == 0 or (_ for _ in ()).throw(OSError(ctypes.get_errno(), "cachestat")),
                "inotify": lambda: libc.inotify_init1(0) >= 0 or (_ for _ in ()).throw(OSError(ctypes.get_errno(), "inotify")),
            }}
            for name, fn in tries.items():
                try:
                    fn()
                    got[name] = "OK"
                except OSError as exc:
                    got[name] = exc.errno
            fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a POSIX read lock: allowed, and invisible without F_GETLK
            import sqlite3  # the sandbox's own files keep working locks
            db = sqlite3.connect("t.db")
            db.execute("create table t(x)")
            db.execute("insert into t values (42)")
            db.commit()
            got["sqlite"] = db.execute("select x from t").fetchone()[0]
            return got
        print(unhooked(probe), flush=True)
        time.sleep(2)
        """
    )
    thread, box = _in_background(model_call, tool, code)
    time.sleep(1.2)
    with open(shared, "rb") as f:  # the host takes the lock the code tried to hold
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    thread.join()
    text = box["result"].text
    assert text.startswith("{"), text
    got = eval(text.splitlines()[0])  # noqa: S307 -- our own repr
    assert got.pop("sqlite") == 42
    assert got == dict.fromkeys(got, 1), got  # EPERM from seccomp, every one


def test_clone_cannot_make_namespaces_even_when_processes_are_allowed(forking_tool):
    nr = {"x86_64": 56, "aarch64": 220}[platform.machine()]
    code = attack(
        f"""
        import ctypes
        def clone_ns():
            libc = ctypes.CDLL(None, use_errno=True)
            made = {{}}
            for name, flag in (("user", 0x10000000), ("net", 0x40000000), ("mount", 0x00020000), ("pid", 0x20000000)):
                pid = libc.syscall({nr}, flag | 17, None, None, None, None)  # | SIGCHLD
                if pid == 0:
                    os._exit(0)
                made[name] = ctypes.get_errno() if pid < 0 else "MADE"
            plain = os.fork()
            if plain == 0:
                os._exit(0)
            os.waitpid(plain, 0)
            return made
        print(unhooked(clone_ns))
        """
    )
    result = model_call(forking_tool, code)
    assert eval(result.text) == {"user": 1, "net": 1, "mount": 1, "pid": 1}, result.text  # noqa: S307


# -- host users and cgroups as units --------------------------------------------------------------------------


def test_uid_range_is_picked_from_what_the_namespace_maps():
    assert pick_uid_range([(0, 4294967295)]) == DEFAULT_UID_RANGE
    assert pick_uid_range([(0, 65536)]) == (1000, 64534)  # a rootless container: below nobody, above system ids
    assert pick_uid_range([(0, 1)]) is None


def test_a_root_trainer_without_a_spare_uid_is_refused_in_one_line(monkeypatch):
    import mcore_agentic.tools.host_user as host_user

    monkeypatch.setattr(host_user.os, "geteuid", lambda: 0)
    monkeypatch.setattr(host_user, "read_id_map", lambda path: [(0, 1)])
    monkeypatch.setattr(host_user, "_outside_of", lambda path, inside: 0)
    with pytest.raises(HostUserError) as err:
        resolve_host_user("auto", None)
    message = str(err.value)
    assert "\n" not in message and "host_user: trainer" in message and "no spare uid" in message
    weak = resolve_host_user("trainer", None)
    assert weak.is_host_root and weak.lease_uid(0) == (0, None)
    assert weak.maps(0) == ("65534 0 1\n", f"65534 {os.getegid()} 1\n")
    with pytest.raises(HostUserError, match="host_uid_range"):
        resolve_host_user("auto", (5, 10))


@pytest.mark.skipif(not AS_ROOT, reason="dedicated uids are leased by a root trainer only")
def test_two_trainer_processes_never_lease_the_same_uid_at_once():
    """The lease is host-wide: another process starting from the same id gets the next free one."""
    host = resolve_host_user("auto", (DEFAULT_UID_RANGE[0] + 5000, 3))
    held = [host.lease_uid(0) for _ in range(3)]  # every id of the range
    assert sorted(uid for uid, _ in held) == [DEFAULT_UID_RANGE[0] + 5000 + i for i in range(3)]
    other = subprocess.run(
        [sys.executable, "-c", (
            f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from mcore_agentic.tools.host_user import resolve_host_user\n"
            f"host = resolve_host_user('auto', ({DEFAULT_UID_RANGE[0] + 5000}, 3))\n"
            "try:\n    print(host.lease_uid(0))\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
        )],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "HostUserError" in other.stdout and "in use" in other.stdout, other.stdout + other.stderr
    os.close(held[1][1])  # one execution ends: its uid is free again, for any process
    uid, fd = host.lease_uid(7)
    assert uid == held[1][0]
    for _, lease in [held[0], held[2], (uid, fd)]:
        os.close(lease)


def test_v2_sandbox_cgroups_stay_inside_the_trainers_limits(tmp_path):
    """Beside the trainer inside a job's own level, or under it at the root; never beside a systemd unit or at the root."""

    def level(path, subtree):
        path.mkdir(parents=True, exist_ok=True)
        (path / "cgroup.subtree_control").write_text(subtree)

    level(tmp_path / "job_1" / "step_0" / "user", "cpu memory pids\n")
    (tmp_path / "job_1" / "step_0" / "user" / "task_0").mkdir()
    assert _v2_parents(tmp_path, "/job_1/step_0/user/task_0") == [tmp_path / "job_1" / "step_0" / "user"]
    level(tmp_path / "job_2", "pids\n")  # the job does not delegate memory: nothing is enabled for it
    assert _v2_parents(tmp_path, "/job_2/task_0") == []
    level(tmp_path / "system.slice", "cpu memory pids\n")  # a service's sibling would leave the service's limits
    assert _v2_parents(tmp_path, "/system.slice/trainer.service") == []
    level(tmp_path, "cpu memory pids\n")
    assert _v2_parents(tmp_path, "/container") == []  # a sibling at the root leaves the container
    assert _v2_parents(tmp_path, "/") == [tmp_path]  # the trainer is at the root: under it


def test_stale_cgroups_of_a_dead_owner_are_removed_and_live_ones_kept():
    me = OwnerTag.this_process()
    found, where = MemoryCgroups.discover(me)
    if found is None:
        pytest.skip(f"no writable memory cgroup here ({where})")
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent = found.root.parent
    stale = parent / f"{PREFIX}.{me.pidns}.{dead.pid}.1"
    foreign = parent / f"{PREFIX}.{me.pidns + 1}.{dead.pid}.1"  # another PID namespace: not ours to judge
    foreign.mkdir()
    (stale / "w0").mkdir(parents=True)
    MemoryCgroups.discover(me)
    assert not stale.exists()
    assert found.root.exists()  # its own, live owner's directory stays
    assert foreign.exists()
    foreign.rmdir()
