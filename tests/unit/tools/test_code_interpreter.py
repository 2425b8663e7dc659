"""PythonCodeTool: real bubblewrap sandboxes under limits; every failure mode is an observation and the batch goes on.

Escape attempts live in test_sandbox_escapes.py; this file covers ordinary behaviour, limits and configuration.
"""

import asyncio
import os

import pytest

from mcore_agentic.tools.base import safe_execute
from mcore_agentic.tools.code_interpreter import PythonCodeTool, strip_code_fence
from mcore_agentic.tools.executor import LocalExecutor

SCHEMA = {"type": "function", "function": {"name": "code_interpreter"}}


@pytest.fixture(scope="module")
def tool():
    executor = LocalExecutor(max_workers=4)
    # The CPU limit sits well above the wall-clock limit, so a busy loop always ends by the wall clock
    # (equal limits race: a fast CPU spends its 3 CPU-seconds before the 3 s timer fires).
    code_tool = PythonCodeTool({"timeout_s": 3, "cpu_time_s": 30, "memory_mb": 512, "max_output_chars": 200}, SCHEMA)
    code_tool.bind_executor(executor)
    yield code_tool
    executor.shutdown()


def _run(tool, code):
    return asyncio.run(tool.execute("req", {"code": code}))


def test_prints_stdout_and_stderr(tool):
    result = _run(tool, "import sys, math\nprint(math.factorial(10))\nprint('warn', file=sys.stderr)")
    assert result.text == "3628800\nstderr:\nwarn"
    assert not result.is_error and result.metrics["exit_code"] == 0 and result.metrics["timed_out"] == 0


def test_exception_traceback_without_sandbox_frames(tool):
    result = _run(tool, "def f():\n    return 1 / 0\nf()")
    assert result.is_error and result.metrics["exit_code"] == 1
    assert 'File "<code>", line 2, in f' in result.text and "ZeroDivisionError: division by zero" in result.text
    assert "sandbox_child" not in result.text


def test_syntax_error(tool):
    result = _run(tool, "def f(:\n    pass")
    assert result.is_error and "SyntaxError" in result.text


def test_infinite_loop_times_out(tool):
    result = _run(tool, "while True:\n    pass")
    assert result.is_error and result.metrics["timed_out"] == 1
    assert "timed out after 3 s" in result.text


def test_cpu_time_limit_is_an_observation():
    executor = LocalExecutor(max_workers=1)
    cpu_bound = PythonCodeTool({"timeout_s": 60, "cpu_time_s": 1}, SCHEMA)
    cpu_bound.bind_executor(executor)
    try:
        result = _run(cpu_bound, "while True:\n    pass")
    finally:
        executor.shutdown()
    assert result.is_error and result.metrics["timed_out"] == 0
    assert "CPU time limit exceeded" in result.text and result.metrics["duration_s"] < 30


def test_reading_outside_the_working_directory_is_blocked(tool):
    result = _run(tool, "print(open('/etc/passwd').read())")
    assert result.is_error and "access to '/etc/passwd' is blocked" in result.text
    assert "root:" not in result.text


def test_socket_to_localhost_is_blocked(tool):
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', 22))\nprint('connected')"
    result = _run(tool, code)
    assert result.is_error and "connected" not in result.text.replace("connect(", "")
    assert "network access is blocked" in result.text


def test_network_namespace_has_only_loopback(tool):
    result = _run(tool, "import socket\nprint(sorted(name for _, name in socket.if_nameindex()))")
    assert result.metrics["sandboxed"] == 1
    assert result.text == "['lo']"


def test_no_subprocess_no_signals(tool):
    spawn = _run(tool, "import subprocess\nsubprocess.run(['cat', '/etc/passwd'])")
    assert spawn.is_error and "subprocess.Popen is blocked" in spawn.text
    kill = _run(tool, f"import os\nos.kill({os.getpid()}, 9)")
    assert kill.is_error and "os.kill is blocked" in kill.text


def test_minimal_environment_and_private_working_directory(tool, monkeypatch):
    monkeypatch.setenv("MCORE_TEST_SECRET", "hunter2")
    code = "import os\nopen('note.txt', 'w').write('kept')\nprint(open('note.txt').read())\nprint(os.getcwd())\nprint(sorted(os.environ))"
    result = _run(tool, code)
    kept, cwd, env = result.text.splitlines()
    assert kept == "kept" and cwd == "/sandbox"
    assert "MCORE_TEST_SECRET" not in env and "PATH" in env


def test_output_and_memory_limits(tool):
    big = _run(tool, "print('x' * 10000)")
    assert "...[output truncated]..." in big.text and len(big.text) < 400
    flood = _run(tool, "import sys\nwhile True:\n    sys.stdout.write('y' * 100000)")
    assert flood.is_error and "the output passed 16 MB and the execution was stopped" in flood.text  # output cap
    memory = _run(tool, "x = bytearray(1024 ** 3)")
    assert memory.is_error and "MemoryError" in memory.text


def test_bad_calls_and_fences(tool):
    assert _run(tool, "   ").is_error
    assert asyncio.run(tool.execute("req", {"code": 5})).is_error
    assert strip_code_fence("```python\nprint(1)\n```") == "print(1)"
    assert _run(tool, "```py\nprint(2 + 2)\n```").text == "4"


def test_batch_continues_past_failures(tool):
    codes = ["print(1)", "open('/etc/shadow').read()", "while True: pass", "import socket; socket.create_connection(('127.0.0.1', 80))", "print(2)"]

    async def main():
        return await asyncio.gather(*(safe_execute(tool, f"r{i}", {"code": c}, timeout=20) for i, c in enumerate(codes)))

    results = asyncio.run(main())
    assert [r.is_error for r in results] == [False, True, True, True, False]
    assert results[0].text == "1" and results[4].text == "2"


def test_config_errors_name_the_key():
    from mcore_agentic.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=r"config.timeout_s: must be > 0"):
        PythonCodeTool({"timeout_s": 0}, SCHEMA)
    with pytest.raises(ConfigError, match=r"config.memory_limit.*did you mean"):
        PythonCodeTool({"memory_limit": 5}, SCHEMA)


def test_common_stdlib_and_site_packages_still_work(tool):
    code = (
        "import asyncio, fractions, json, statistics, tempfile\n"
        "import numpy as np\n"
        "async def f():\n    return 2\n"
        "with tempfile.NamedTemporaryFile() as fh:\n    pass\n"
        "print(asyncio.run(f()), fractions.Fraction(1, 3) * 3, statistics.mean([1, 2, 3]), int(np.arange(4).sum()))"
    )
    result = _run(tool, code)
    assert result.text == "2 1 2 6", result.text


def test_stdlib_only_mode_and_extra_read_paths(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("shared input")
    tmp_path.chmod(0o755)  # readable by others: a root trainer's sandboxes run as an unprivileged uid
    data.chmod(0o644)
    tool = PythonCodeTool({"timeout_s": 5, "site_packages": False, "extra_read_paths": [str(tmp_path)]}, SCHEMA)
    executor = LocalExecutor(max_workers=1)
    tool.bind_executor(executor)
    try:
        no_numpy = _run(tool, "import numpy")
        readable = _run(tool, f"print(open({str(data)!r}).read())")
        not_writable = _run(tool, f"open({str(data)!r}, 'w').write('x')")
    finally:
        executor.shutdown()
    assert no_numpy.is_error and "ModuleNotFoundError" in no_numpy.text
    assert readable.text == "shared input"
    assert not_writable.is_error and "blocked" in not_writable.text and data.read_text() == "shared input"


def test_refuses_to_start_without_a_working_bwrap(tmp_path):
    from mcore_agentic.utils.errors import ConfigError

    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(ConfigError) as err:
        PythonCodeTool({"bwrap_path": str(broken)}, SCHEMA)
    message = str(err.value)
    assert "\n" not in message and message.startswith("sandbox: bubblewrap cannot build the sandbox here")
    assert "No permissions to create new namespace" in message and "unsafe_subprocess" in message
    with pytest.raises(ConfigError, match=r"bwrap_path '/nonexistent/bwrap' is not an executable file"):
        PythonCodeTool({"bwrap_path": "/nonexistent/bwrap"}, SCHEMA)


def test_unsafe_subprocess_only_when_asked_and_warns_once(caplog):
    import mcore_agentic.tools.sandbox as sandbox_module

    sandbox_module._warned.discard("unsafe")
    with caplog.at_level("WARNING", logger="mcore_agentic.tools.sandbox"):
        unsafe = PythonCodeTool({"sandbox": "unsafe_subprocess", "timeout_s": 5, "warm_pool": 0}, SCHEMA)
        PythonCodeTool({"sandbox": "unsafe_subprocess", "timeout_s": 6, "warm_pool": 0}, SCHEMA)
    warnings = [r for r in caplog.records if "WITHOUT isolation" in r.getMessage()]
    assert len(warnings) == 1
    result = _run(unsafe, "import os\nprint(os.getcwd() != '/sandbox')")
    assert result.text == "True" and result.metrics["sandboxed"] == 0


def test_32_concurrent_executions_each_get_their_own_result():
    """Tool timeouts count the tool's own run only: 32 calls through 4 executor slots all finish."""
    executor = LocalExecutor(max_workers=4)
    tool = PythonCodeTool({"timeout_s": 10, "warm_pool": 2}, SCHEMA)
    tool.bind_executor(executor)

    async def main():
        calls = [safe_execute(tool, f"r{i}", {"code": f"import time\ntime.sleep(0.2)\nprint({i} * {i})"}, timeout=3) for i in range(32)]
        return await asyncio.gather(*calls)

    try:
        results = asyncio.run(main())
    finally:
        executor.shutdown()
    assert [r.text for r in results] == [str(i * i) for i in range(32)]
    assert not any(r.is_error for r in results)


def test_editable_install_hooks_are_hidden_unless_their_sources_are_readable(tmp_path):
    """An editable install's import hook maps packages onto sources the sandbox does not mount: not run there."""
    from mcore_agentic.tools.bwrap import editable_finders, interpreter_image

    site, src = tmp_path / "site-packages", tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    site.mkdir()
    (site / "__editable__.pkg-1.0.pth").write_text("import __editable___pkg_1_0_finder; __editable___pkg_1_0_finder.install()\n")
    (site / "__editable___pkg_1_0_finder.py").write_text(f"MAPPING: dict[str, str] = {{'pkg': {str(src / 'pkg')!r}}}\n")
    (site / "__editable__.flat-1.0.pth").write_text(f"{src}\n")  # a plain path line: nothing to run
    hook = str(site / "__editable__.pkg-1.0.pth")
    assert editable_finders([str(site)], ()) == [hook]
    assert editable_finders([str(site)], (str(src),)) == []  # the code may read the sources: the hook stays
    # this repository's own editable install (the suite's venv) is hidden, and site-packages still import
    image = interpreter_image(True)
    assert all(path.endswith(".pth") and "__editable__" in os.path.basename(path) for path in image.hidden)
