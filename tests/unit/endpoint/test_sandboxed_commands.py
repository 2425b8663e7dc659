"""Agent commands in a per-sample sandbox (``rollout.agent.sandbox=bwrap``): a real :class:`AgentSource` (uvicorn on
loopback and on its Unix socket), real bubblewrap, real processes, on a scripted engine.

Each sample's command reaches its session only through the forwarder on the sandbox's loopback, works in a copy of
the task's directory that a reward command then grades, cannot write to the host or reach another address, and
leaves no directory and no process behind. Skipped (with bubblewrap's reason) only where bubblewrap cannot run.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from mcore_agentic.endpoint.programs import CommandRunner, SessionAccess, run_program
from mcore_agentic.endpoint.source import AgentSource
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import AgentConfig, AgentSandboxLimits, MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences, run_sync
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.tools.command_sandbox import STATE_PREFIX, CommandSandbox
from mcore_agentic.utils.errors import ConfigError
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = {"Q-add": [call("add", a=2, b=3), "The answer is 5."]}
ADD = AddTool().get_openai_tool_schema()
ROWS = [{"prompt": [{"role": "system", "content": "You can use tools."}, {"role": "user", "content": f"Q-add {i}"}],
         "data_source": "test", "reward_model": {"ground_truth": "5"}} for i in range(2)]
PY = sys.executable
LIMITS = AgentSandboxLimits(memory_cgroup="auto")  # the tests run where bubblewrap does, with or without cgroups

# The agent: the standard library only (the sandbox binds the trainer's interpreter, not its site-packages). It talks
# to its session at OPENAI_BASE_URL with urllib, runs the add tool itself, writes its answer into its work directory
# and a file into its HOME, then runs the escapes the test names (each must fail) and prints their report.
AGENT = textwrap.dedent("""
    import errno, json, os, socket, sys, urllib.request
    row = json.load(open(os.environ["MCORE_AGENTIC_ROW"]))
    assert row == json.load(sys.stdin)
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    assert base.startswith("http://127.0.0.1:18080/sessions/"), base
    tools = [json.loads(open("tool.json").read())]
    messages = list(row["prompt"])
    while True:
        body = json.dumps({"model": "policy", "messages": messages, "tools": tools}).encode()
        request = urllib.request.Request(base + "/chat/completions", body, {
            "Authorization": "Bearer " + key, "Content-Type": "application/json"})
        message = json.load(urllib.request.urlopen(request, timeout=30))["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for c in message["tool_calls"]:
            a = json.loads(c["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(a["a"] + a["b"])})
    open("answer.txt", "w").write(messages[-1]["content"].split()[-1].rstrip("."))
    os.makedirs(os.path.expanduser("~/.config/agent"), exist_ok=True)
    open(os.path.expanduser("~/.config/agent/state"), "w").write("kept for the reward command")
    escaped = []
    for path in json.load(open("escapes.json")).get("write", []):
        try:
            with open(path, "w") as f:
                f.write("escaped")
            escaped.append("wrote " + path)
        except OSError:
            pass
    for host, port in json.load(open("escapes.json")).get("connect", []):
        try:
            socket.create_connection((host, port), timeout=3).close()
            escaped.append(f"connected to {host}:{port}")
        except OSError:
            pass
    for path in json.load(open("escapes.json")).get("unix", []):
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            escaped.append("connected to " + path)
        except OSError:
            pass
    try:
        socket.getaddrinfo("example.com", 443)
        escaped.append("resolved example.com")
    except OSError:
        pass
    tmp = json.load(open("escapes.json")).get("tmp")
    if tmp:  # the sandbox's own /tmp takes it
        open(tmp, "w").write("private")
    if escaped:
        sys.exit("escaped: " + "; ".join(escaped))
    print("the harness's own output, not a reward")
""")
GRADE = (f"{PY} -I -c \"import json, os; print('grading'); print(json.dumps({{'score': float(open('answer.txt')"
         ".read() == '5' and os.path.exists(os.path.expanduser('~/.config/agent/state')))}))\"")


@pytest.fixture(scope="module")
def tok():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


@pytest.fixture(scope="module")
def bwrap_works(tmp_path_factory):
    try:
        CommandSandbox(LIMITS, sample_dirs=str(tmp_path_factory.mktemp("probe"))).close()
    except ConfigError as exc:
        pytest.skip(f"bubblewrap cannot run here: {exc}")


def _template(tmp_path: Path) -> Path:
    """The task's repository: the agent, its tool's schema, and the escapes it is to try (none unless a test says)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "agent.py").write_text(AGENT)
    (repo / "tool.json").write_text(json.dumps(ADD))
    (repo / "escapes.json").write_text("{}")
    return repo


def _roll(tok: Any, sample_dirs: Path, rows: list[dict] = ROWS, **agent: Any) -> tuple[Any, AgentSource]:
    agent.setdefault("sandbox", "bwrap")
    agent.setdefault("sandbox_limits", LIMITS)
    cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                        multi_turn=MultiTurnConfig(max_assistant_turns=5),
                        agent=AgentConfig(sample_dirs=str(sample_dirs), **agent))
    source = AgentSource(cfg, ScriptedEngine(tok, SCRIPTS), ChatTokenizer(tok), version=lambda: 3)
    try:
        return source.roll_out(rows, cfg), source
    except BaseException:
        source.close()
        raise


def _state_dirs(sample_dirs: Path) -> list[Path]:
    return [p for p in sample_dirs.iterdir() if p.name.startswith(STATE_PREFIX)]


def _sample_dirs(state: Path) -> list[Path]:
    return [p for p in state.iterdir() if p.name.startswith("s") and p.name[1:].isdigit()]


def _failures(batch: Any) -> list[str]:
    return [m["error"] for m in batch["request_metrics"] if m["state"] != "completed"]


def test_a_sandboxed_command_reaches_its_session_and_its_reward_command_grades_its_work(tok, tmp_path, bwrap_works):
    repo, dirs = _template(tmp_path), tmp_path / "samples"
    dirs.mkdir()
    batch, source = _roll(tok, dirs, command=f"{PY} -I agent.py", workdir=str(repo), reward_command=GRADE)
    try:
        assert _failures(batch) == []
        assert batch["source_reward"] == [1.0, 1.0]  # the reward command's last line, not the command's
        loop_cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                                 multi_turn=MultiTurnConfig(max_assistant_turns=5))
        loop = run_sync(generate_sequences(ROWS, ScriptedEngine(tok, SCRIPTS), {"add": AddTool()}, None, loop_cfg, tok))
        assert batch["input_ids"].tolist() == loop["input_ids"].tolist()  # token-exact through the forwarder
        assert batch["response_mask"].tolist() == loop["response_mask"].tolist()
        (state,) = _state_dirs(dirs)
        assert _sample_dirs(state) == []  # each removed once its reward was read
        assert sorted(p.name for p in repo.iterdir()) == ["agent.py", "escapes.json", "tool.json"]  # template untouched
    finally:
        source.close()
    assert _state_dirs(dirs) == []


def test_a_sandboxed_command_cannot_write_to_the_host_or_reach_another_address(tok, tmp_path, bwrap_works):
    marker = f"escape-{uuid.uuid4().hex}"
    dirs = tmp_path / "samples"
    dirs.mkdir()
    repo = _template(tmp_path)
    cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                        multi_turn=MultiTurnConfig(max_assistant_turns=5),
                        agent=AgentConfig(command=f"{PY} -I agent.py", sandbox="bwrap", workdir=str(repo),
                                          reward_command=GRADE, sample_dirs=str(dirs), sandbox_limits=LIMITS))
    source = AgentSource(cfg, ScriptedEngine(tok, SCRIPTS), ChatTokenizer(tok), version=lambda: 3)
    listener = socket.socket()  # a port open on the host's loopback
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        endpoint_port = int(source.url.rsplit(":", 1)[1])  # the endpoint's own TCP port on the host, and its socket
        writes = [str(ROOT / marker), os.path.join(os.path.expanduser("~"), marker), str(dirs / marker),
                  str(repo / marker), f"/etc/{marker}", f"/usr/{marker}", f"/{marker}"]
        (repo / "escapes.json").write_text(json.dumps({  # read by each sample's copy of the repository
            "write": writes,
            "connect": [["127.0.0.1", endpoint_port], ["127.0.0.1", listener.getsockname()[1]],
                        ["10.255.255.1", 80], ["1.1.1.1", 443]],
            "unix": [source.runner.socket_path, "/run/systemd/private", "/var/run/docker.sock"],
            "tmp": f"/tmp/{marker}",
        }))
        batch = source.roll_out(ROWS, cfg)
    finally:
        listener.close()
        source.close()
    assert _failures(batch) == []  # every escape failed (the agent exits 1 naming any that did not)
    assert batch["source_reward"] == [1.0, 1.0]
    for target in [*writes, f"/tmp/{marker}"]:
        assert not os.path.exists(target), target  # the host is untouched (the sandbox's /tmp is its own tmpfs)
    (repo / "escapes.json").unlink()
    assert sorted(p.name for p in repo.iterdir()) == ["agent.py", "tool.json"]
    assert _state_dirs(dirs) == []


def test_a_timed_out_sandbox_leaves_no_process_and_no_directory(tok, tmp_path, bwrap_works):
    dirs = tmp_path / "samples"
    dirs.mkdir()
    tag = f"{uuid.uuid4().int % 1000}.{os.getpid() % 1000}"
    batch, source = _roll(tok, dirs, rows=ROWS[:1], timeout_s=2.0,
                          command=f"/bin/sh -c 'setsid sleep 9{tag} & sleep 9{tag}'")
    try:
        (m,) = batch["request_metrics"]
        assert m["state"] == "failed" and m["agent_timed_out"] == 1, m
        assert _sample_dirs(_state_dirs(dirs)[0]) == []
    finally:
        source.close()
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"9{tag}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(pid)
        except OSError:
            pass
    assert alive == []
    assert _state_dirs(dirs) == []


def test_the_samples_memory_and_process_limits_hold(tok, tmp_path, bwrap_works):
    """``memory_mb`` is the memory cgroup's limit (all the sample's processes together); ``max_processes`` is the
    sample's own uid's process count (a root trainer's dedicated uid). Each sample first makes its one request."""
    repo, dirs = _template(tmp_path), tmp_path / "samples"
    dirs.mkdir()
    (repo / "hog.py").write_text(textwrap.dedent("""
        import json, os, subprocess, sys, time
        mode = json.load(open(os.environ["MCORE_AGENTIC_ROW"]))["extra_info"]["mode"]
        subprocess.run([sys.executable, "-I", "agent.py"], stdout=subprocess.DEVNULL, check=True)  # its one request
        if mode == "memory":  # two processes of 200 MB each: each under memory_mb, together over it
            code = "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(3)"
            procs = [subprocess.Popen([sys.executable, "-I", "-c", code]) for _ in range(2)]
            print(json.dumps({"score": float(sum(p.wait() != 0 for p in procs))}))
        else:  # forty sleepers, with room for sixteen
            started = 0
            for _ in range(40):
                try:
                    subprocess.Popen(["/bin/sleep", "5"])
                    started += 1
                except OSError:
                    pass
            print(json.dumps({"score": float(started)}))
    """))
    rows = [{**ROWS[i], "extra_info": {"mode": mode}} for i, mode in enumerate(("memory", "processes"))]
    limits = AgentSandboxLimits(memory_cgroup="auto", memory_mb=300, disk_mb=16, max_processes=16)
    batch, source = _roll(tok, dirs, rows=rows, command=f"{PY} -I hog.py", workdir=str(repo), sandbox_limits=limits)
    try:
        sandbox = source.runner.sandbox
        assert _failures(batch) == []
        killed, started = batch["source_reward"]
        if sandbox._cgroups is not None:
            assert killed >= 1  # the cgroup's OOM killer took one of them
        if sandbox._host_user.drops_root:
            assert started < 16  # the bootstrap, its interpreter's threads and the agent count too
    finally:
        source.close()
    assert _state_dirs(dirs) == []


def test_a_failing_reward_command_or_a_missing_row_workdir_fails_only_its_row(tok, tmp_path, bwrap_works):
    repo, dirs = _template(tmp_path), tmp_path / "samples"
    dirs.mkdir()
    rows = [ROWS[0], {**ROWS[1], "extra_info": {"workdir": str(tmp_path / "nosuch")}}]
    batch, source = _roll(tok, dirs, rows=rows, command=f"{PY} -I agent.py", workdir=str(repo),
                          reward_command=f"{PY} -I -c \"import sys; sys.exit('no tests ran')\"")
    source.close()
    errors = [m["error"] for m in batch["request_metrics"]]
    assert "the reward command exited 1: no tests ran" in errors[0]
    assert "extra_info.workdir" in errors[1] and "nosuch" in errors[1]
    assert _state_dirs(dirs) == []


def test_an_unsandboxed_command_gets_a_copy_of_the_workdir_removed_after_its_reward(tok, tmp_path):
    repo, dirs = _template(tmp_path), tmp_path / "samples"
    dirs.mkdir()
    agent = ("import os, sys; sys.stdin.read(); assert os.getcwd() == os.environ['MCORE_AGENTIC_WORKDIR']; "
             "open('answer.txt', 'w').write('5')")
    grade = f"{PY} -c \"print(float(open('answer.txt').read() == '5'))\""
    cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                        agent=AgentConfig(command=f"{PY} -c \"{agent}\"", workdir=str(repo), reward_command=grade,
                                          sample_dirs=str(dirs), timeout_s=30))
    runner = CommandRunner.from_config(cfg.agent)
    access = SessionAccess(base_url="http://127.0.0.1:9/sessions/x/v1", anthropic_base_url="http://127.0.0.1:9/sessions/x",
                           api_key="k", session_id="x")
    outcome = asyncio.run(run_program(None, cfg.agent.command, access, ROWS[0], 30.0, runner=runner))
    assert outcome.error is None and outcome.reward == 1.0, outcome
    assert list(dirs.iterdir()) == [] and not (repo / "answer.txt").exists()


@pytest.mark.parametrize("agent,field", [
    (dict(entrypoint="a:b", sandbox="bwrap"), "rollout.agent.sandbox"),
    (dict(sandbox="bwrap"), "rollout.agent.sandbox"),
    (dict(workdir="/x"), "rollout.agent.workdir"),
    (dict(command="x", reward="reward_fn", reward_command="y"), "rollout.agent.reward_command"),
    (dict(command="x", sandbox="docker"), "rollout.agent.sandbox"),
    (dict(max_processes=0), "rollout.agent.sandbox_limits.max_processes"),
    (dict(memory_mb=64), "rollout.agent.sandbox_limits.memory_mb"),
])
def test_config_errors_are_one_line_naming_the_key(agent, field):
    cls = AgentSandboxLimits if field.startswith("rollout.agent.sandbox_limits.") else AgentConfig
    with pytest.raises(ConfigError) as e:
        cls(**agent)
    assert e.value.field == field and "\n" not in str(e.value)


def test_a_command_the_sandbox_cannot_see_is_one_line_naming_the_fix(tmp_path, bwrap_works):
    tool = tmp_path / "bin" / "harness"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho 1\n")
    tool.chmod(0o755)
    with pytest.raises(ConfigError) as e:
        CommandRunner(str(tool), sandbox="bwrap", limits=LIMITS, sample_dirs=str(tmp_path))
    assert e.value.field == "rollout.agent.command" and "extra_read_paths" in str(e.value)
    runner = CommandRunner(str(tool), sandbox="bwrap", sample_dirs=str(tmp_path),
                           limits=AgentSandboxLimits(memory_cgroup="auto", extra_read_paths=(str(tool.parent),)))
    runner.close()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(STATE_PREFIX)] == []


def test_preflight_reports_the_sandboxs_problems_in_one_line_each(tmp_path, bwrap_works):

    from mcore_agentic.feed.checks import check_agent

    def check(**agent: Any) -> list[ConfigError]:
        problems = check_agent(AgentConfig(**agent))
        assert all("\n" not in str(p) for p in problems), problems
        return problems

    missing = check(command="/nonexistent/harness --flag", sandbox="bwrap", sample_dirs=str(tmp_path / "nosuch"),
                    reward_command="nosuch-grader", sandbox_limits=AgentSandboxLimits(
                        memory_cgroup="auto", extra_read_paths=(str(tmp_path / "missing"),)))
    assert [p.field for p in missing] == ["rollout.agent.command", "rollout.agent.reward_command",
                                          "rollout.agent.sample_dirs", "rollout.agent.sandbox_limits.extra_read_paths"]
    tool = tmp_path / "bin" / "harness"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho 1\n")
    tool.chmod(0o755)
    (outside,) = check(command=str(tool), sandbox="bwrap", sample_dirs=str(tmp_path), sandbox_limits=LIMITS)
    assert outside.field == "rollout.agent.command" and "extra_read_paths" in str(outside)
    assert check(command=f"{tool} --flag", sandbox="bwrap", sample_dirs=str(tmp_path), reward_command="./grade.sh",
                 sandbox_limits=AgentSandboxLimits(memory_cgroup="auto", extra_read_paths=(str(tool.parent),))) == []
    assert [p for p in tmp_path.iterdir() if p.name.startswith(STATE_PREFIX)] == []


# -- the npm harnesses themselves (where `npm install --prefix .harnesses ...` put them: tests/fixtures/harness_requests)
HARNESSES = ROOT / ".harnesses"
CODEX_SETUP = """mkdir -p "$HOME/.codex" && cat > "$HOME/.codex/config.toml" <<TOML
model = "policy"
model_provider = "session"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
[analytics]
enabled = false
[model_providers.session]
name = "session"
base_url = "$OPENAI_BASE_URL"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
TOML
"""
OPENCODE_SETUP = """cat > "$HOME/opencode.json" <<JSON
{"model": "session/policy", "small_model": "session/policy", "autoupdate": false, "share": "disabled",
 "permission": {"*": "allow"}, "provider": {"session": {"npm": "@ai-sdk/openai-compatible", "name": "session",
 "options": {"baseURL": "$OPENAI_BASE_URL", "apiKey": "{env:OPENAI_API_KEY}"},
 "models": {"policy": {"name": "policy", "tool_call": true, "limit": {"context": 32768, "output": 8192}}}}}}
JSON
export OPENCODE_CONFIG="$HOME/opencode.json" OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1
"""
HARNESS_RUNS = {  # (run.sh, binary): each says "hi" once to its session from /workspace
    "claude": ('env DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 "$BIN/claude" -p hi '
               "--output-format json --model policy --dangerously-skip-permissions", "claude"),
    "codex": (CODEX_SETUP + 'exec "$BIN/codex" exec --skip-git-repo-check hi </dev/null', "codex"),
    "qwen": ('env OPENAI_MODEL=policy "$BIN/qwen" hi --auth-type openai --approval-mode yolo --output-format json',
             "qwen"),
    "opencode": (OPENCODE_SETUP + 'exec "$BIN/opencode" run hi </dev/null', "opencode"),
}


@pytest.mark.parametrize("name", sorted(HARNESS_RUNS))
def test_an_npm_harness_runs_sandboxed_against_its_session(tok, tmp_path, bwrap_works, name):
    script, binary = HARNESS_RUNS[name]
    if not (HARNESSES / "node_modules" / ".bin" / binary).exists():
        pytest.skip(f"{binary} is not installed under {HARNESSES} (tests/fixtures/harness_requests/regenerate.sh)")
    repo, dirs = tmp_path / "repo", tmp_path / "samples"
    repo.mkdir()
    dirs.mkdir()
    (repo / "run.sh").write_text(f"BIN={HARNESSES}/node_modules/.bin\n{script}\n")
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "data_source": "test"}]
    cfg = RolloutConfig(prompt_length=131072, response_length=1024, n=1, seed=7,
                        multi_turn=MultiTurnConfig(tokenization_sanity_check_mode="disable"),
                        agent=AgentConfig(command="/bin/sh run.sh", sandbox="bwrap", workdir=str(repo), timeout_s=120,
                                          reward_command="/bin/echo 1", sample_dirs=str(dirs),
                                          sandbox_limits=AgentSandboxLimits(memory_cgroup="auto",
                                                                            extra_read_paths=(str(HARNESSES),))))
    source = AgentSource(cfg, ScriptedEngine(tok, {"": ["Done."]}), ChatTokenizer(tok), version=lambda: 0)
    try:
        batch = source.roll_out(rows, cfg)
    finally:
        source.close()
    assert _failures(batch) == [], _failures(batch)
    assert batch["request_metrics"][-1]["agent_samples"] >= 1 and batch["source_reward"][-1] == 1.0
    assert _state_dirs(dirs) == []
