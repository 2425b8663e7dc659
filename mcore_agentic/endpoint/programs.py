"""Running one agent program for one sample: a Python entry point or a command line, with a timeout.

Whatever the program does, :func:`run_program` returns a :class:`ProgramOutcome`: the reward it gave (a number,
or a dict of reward parts whose ``score`` or ``reward`` is the reward and whose other numbers are logged), or
why it failed (it raised, exited non-zero, timed out, or returned something that is not a reward). It never
raises for the program's faults.

A command runs as its :class:`CommandRunner` says (``rollout.agent.*``): on the host, or in a bubblewrap sandbox of
its own per sample (:mod:`mcore_agentic.tools.command_sandbox`, which reaches the session through a forwarder on the
sandbox's loopback to the endpoint's Unix socket); in the trainer's working directory, or in a per-sample copy of
the task's directory; its reward its own last stdout line, or a reward command's run in that directory after it.
The per-sample directories are removed once the reward is read.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import os
import shlex
import shutil
import signal
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_agentic.tools.base import format_traceback
from mcore_agentic.utils.errors import ConfigError


@dataclass(frozen=True)
class SessionAccess:
    """What a program is given to reach its session."""

    base_url: str
    """The OpenAI base URL (``.../sessions/{id}/v1``)."""
    anthropic_base_url: str
    """The Anthropic base URL (``.../sessions/{id}``: the client appends ``/v1/messages``)."""
    api_key: str
    session_id: str


@dataclass
class ProgramOutcome:
    reward: float | None = None
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    """One line: why the sample failed (None: it ran to the end)."""
    error_type: str | None = None
    traceback: str | None = None
    timed_out: bool = False


def load_entrypoint(spec: str) -> Callable[..., Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names (a path relative to the working
    directory); one line naming ``rollout.agent.entrypoint`` if it cannot load."""
    module_name, _, name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = os.path.abspath(module_name)
            loader = importlib.util.spec_from_file_location(f"agent_program_{abs(hash(path))}", path)
            if loader is None or loader.loader is None or not os.path.isfile(path):
                raise ImportError(f"no Python file {path}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise ConfigError("rollout.agent.entrypoint", f"cannot load {spec!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError("rollout.agent.entrypoint", f"{spec!r} is not callable")
    return fn


def reward_of(value: Any) -> tuple[float | None, dict[str, float], str | None]:
    """``(reward, parts, problem)`` of what a program returned: a finite number, or a dict with ``score`` or
    ``reward`` (other finite numbers are kept as parts); None with no problem when it returned nothing."""
    if value is None:
        return None, {}, None
    if isinstance(value, bool) or not isinstance(value, int | float | dict):
        return None, {}, f"returned {type(value).__name__}, not a reward (a number or a dict with 'score')"
    if isinstance(value, dict):
        parts = {str(k): float(v) for k, v in value.items()
                 if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        key = "score" if "score" in parts else "reward" if "reward" in parts else None
        if key is None:
            return None, {}, f"returned a dict without a finite 'score' or 'reward': {sorted(value)[:8]}"
        return parts.pop(key), parts, None
    if not math.isfinite(value):
        return None, {}, f"returned a non-finite reward {value!r}"
    return float(value), {}, None


async def run_program(entry: Callable[..., Any] | None, command: str | None, access: SessionAccess,
                      row: dict[str, Any], timeout_s: float, *, runner: CommandRunner | None = None) -> ProgramOutcome:
    """Run the entry point or the command for one sample (module docstring); ``runner``: how the command runs
    (default: on the host, in the working directory)."""
    try:
        if entry is not None:
            value = await asyncio.wait_for(_call(entry, access, row), timeout_s)
        elif runner is not None:
            value = await runner.run(access, row, timeout_s)
        else:
            assert command is not None
            value = await _run_command(command, access, row, timeout_s)
    except TimeoutError:
        return ProgramOutcome(error=f"the agent program ran past rollout.agent.timeout_s={timeout_s:g}",
                              error_type="TimeoutError", timed_out=True)
    except Exception as exc:  # noqa: BLE001 -- the program's fault fails its sample, not the step
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return ProgramOutcome(error=f"{type(exc).__name__}: {first}" if first else type(exc).__name__,
                              error_type=type(exc).__name__, traceback=format_traceback(exc))
    reward, parts, problem = reward_of(value)
    if problem is not None:
        return ProgramOutcome(error=f"the agent program {problem}", error_type="BadReward")
    return ProgramOutcome(reward=reward, parts=parts)


async def _call(entry: Callable[..., Any], access: SessionAccess, row: dict[str, Any]) -> Any:
    offered = {"base_url": access.base_url, "api_key": access.api_key, "row": row,
               "anthropic_base_url": access.anthropic_base_url, "session_id": access.session_id}
    params = inspect.signature(entry).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = offered if takes_all else {k: v for k, v in offered.items() if k in params}
    if inspect.iscoroutinefunction(entry):
        return await entry(**kwargs)
    result = await asyncio.to_thread(entry, **kwargs)  # a blocking program must not hold the rollout's loop
    return await result if inspect.isawaitable(result) else result


async def _run_command(command: str, access: SessionAccess, row: dict[str, Any], timeout_s: float) -> Any:
    return await CommandRunner(command).run(access, row, timeout_s)


class CommandRunner:
    """How the command form runs each sample (``rollout.agent.command``, ``sandbox``, ``workdir``,
    ``reward_command``, ``sample_dirs``; module docstring). Building one with ``sandbox=bwrap`` proves the sandbox
    works here (one-line :class:`ConfigError` naming the key and the fix if not)."""

    def __init__(self, command: str, *, reward_command: str | None = None, workdir: str | None = None,
                 sandbox: str = "none", limits: Any = None, sample_dirs: str | None = None):
        self.argv = shlex.split(command)
        self.reward_argv = shlex.split(reward_command) if reward_command else None
        self.workdir = workdir
        self.sample_dirs = sample_dirs
        self.sandbox = None
        if sandbox == "bwrap":
            from mcore_agentic.tools.command_sandbox import CommandSandbox

            self.sandbox = CommandSandbox(limits, sample_dirs=sample_dirs)
            try:
                self.argv = self._inside(self.argv, "rollout.agent.command")
                if self.reward_argv is not None:
                    self.reward_argv = self._inside(self.reward_argv, "rollout.agent.reward_command")
            except BaseException:
                self.close()
                raise

    @classmethod
    def from_config(cls, agent: Any) -> CommandRunner:
        """The runner of ``rollout.agent`` (an :class:`~mcore_agentic.rollout.config.AgentConfig` with a command)."""
        return cls(agent.command, reward_command=agent.reward_command, workdir=agent.workdir, sandbox=agent.sandbox,
                   limits=agent.sandbox_limits, sample_dirs=agent.sample_dirs)

    @property
    def socket_path(self) -> str | None:
        """Where the endpoint must listen too for sandboxed commands to reach it (None: not sandboxed)."""
        return self.sandbox.socket_path if self.sandbox is not None else None

    def _inside(self, argv: list[str], key: str) -> list[str]:
        """``argv`` with its program as the host's ``PATH`` finds it, which must be a path the sandbox has (a path
        with a slash but relative names a file of the work directory and is left as it is)."""
        assert self.sandbox is not None
        if not argv:
            raise ConfigError(key, "is empty: set a command line")
        program = argv[0]
        if "/" in program and not os.path.isabs(program):
            return argv
        found = shutil.which(program) if "/" not in program else program
        if found is None:
            raise ConfigError(key, f"{program!r} is not an executable on PATH or a path to one")
        found = os.path.abspath(found)
        if not self.sandbox.visible(found):
            where = os.path.dirname(os.path.realpath(found))
            raise ConfigError(key, f"{found} is not inside the sandbox: add the directory it is installed in (e.g. "
                                   f"{where}) to rollout.agent.sandbox_limits.extra_read_paths")
        return [found, *argv[1:]]

    def template(self, row: dict[str, Any]) -> str | None:
        """The directory copied into the sample's work directory: the row's ``extra_info.workdir``, else
        ``rollout.agent.workdir``; one line naming the field if it is not a directory."""
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        path, field_name = (extra.get("workdir"), "extra_info.workdir") if extra.get("workdir") else (
            self.workdir, "rollout.agent.workdir")
        if path is None:
            return None
        path = os.path.abspath(os.path.expanduser(str(path)))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"the row's {field_name} {path} is not a directory")
        return path

    async def run(self, access: SessionAccess, row: dict[str, Any], timeout_s: float) -> Any:
        """The sample's reward value (the last non-empty stdout line of the reward command, else of the command)."""
        payload = json.dumps(row, ensure_ascii=False, default=str)
        env = {"OPENAI_BASE_URL": access.base_url, "OPENAI_API_KEY": access.api_key,
               "ANTHROPIC_BASE_URL": access.anthropic_base_url, "ANTHROPIC_API_KEY": access.api_key,
               "MCORE_AGENTIC_SESSION_ID": access.session_id}
        template = self.template(row)
        if self.sandbox is not None:
            out, who = await self._run_sandboxed(env, payload, template, timeout_s)
        else:
            out, who = await self._run_on_host(env, payload, template, timeout_s)
        return _reward_line(out, who)

    async def _run_on_host(self, env: dict[str, str], payload: str, template: str | None,
                           timeout_s: float) -> tuple[str, str]:
        sample = await asyncio.to_thread(_host_sample_dir, template, self.sample_dirs) if template else None
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="agent_row_", delete=False) as f:
            f.write(payload)
            row_file = f.name
        env = {**os.environ, **env, "MCORE_AGENTIC_ROW": row_file}
        cwd = None
        if sample is not None:
            cwd = env["MCORE_AGENTIC_WORKDIR"] = str(sample / "work")
        try:
            out = await _host_process(self.argv, env, payload, cwd, timeout_s, "the agent command")
            if self.reward_argv is None:
                return out, "the agent command"
            return await _host_process(self.reward_argv, env, payload, cwd, timeout_s, "the reward command"), \
                "the reward command"
        finally:
            os.unlink(row_file)
            if sample is not None:
                await asyncio.to_thread(shutil.rmtree, sample, True)

    async def _run_sandboxed(self, env: dict[str, str], payload: str, template: str | None,
                             timeout_s: float) -> tuple[str, str]:
        from mcore_agentic.tools.command_sandbox import FORWARD_URL

        sandbox = self.sandbox
        assert sandbox is not None
        for key in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"):  # the same routes, through the sandbox's forwarder
            env[key] = FORWARD_URL + urllib.parse.urlsplit(env[key]).path
        stop = threading.Event()
        held: list[Any] = []

        def work() -> tuple[str, str]:
            sample = sandbox.prepare(template, payload)
            held.append(sample)
            try:
                if stop.is_set():
                    sample.kill()
                ran = sandbox.run(sample, self.argv, env, payload.encode(), timeout_s)
                _check(ran, "the agent command", sandbox.limits)
                if self.reward_argv is None:
                    return ran.stdout, "the agent command"
                ran = sandbox.run(sample, self.reward_argv, env, payload.encode(), timeout_s)
                _check(ran, "the reward command", sandbox.limits)
                return ran.stdout, "the reward command"
            finally:
                sandbox.release(sample)

        def cancel() -> None:
            stop.set()
            for sample in held:
                sample.kill()

        return await _in_thread(work, cancel)

    def close(self) -> None:
        """Kill what still runs in a sandbox and remove every per-sample directory (and the endpoint's socket)."""
        if self.sandbox is not None:
            self.sandbox.close()


def _check(ran: Any, who: str, limits: Any) -> None:
    """Raise what a run that did not exit 0 means for its sample."""
    if ran.timed_out:
        raise TimeoutError(f"{who} timed out")
    if ran.output_exceeded:
        raise RuntimeError(f"{who} printed more than rollout.agent.sandbox_limits.max_file_mb={limits.max_file_mb:g} MB")
    if ran.killed or ran.returncode is None:
        raise RuntimeError(f"{who} was stopped")
    if ran.returncode != 0:
        tail = ran.stderr.strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"{who} exited {ran.returncode}: {tail[0][:300]}")


def _reward_line(out: str, who: str) -> Any:
    """The reward in ``out``'s last non-empty line (JSON: a number or an object); None when it printed nothing."""
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise ValueError(f"{who}'s last stdout line is not a reward: {lines[-1][:200]!r}") from None


def _host_sample_dir(template: str, sample_dirs: str | None) -> Path:
    """A fresh directory with ``template`` copied into its ``work/`` (unsandboxed commands)."""
    root = Path(tempfile.mkdtemp(prefix="mcore_agentic_sample.", dir=sample_dirs))
    try:
        shutil.copytree(template, root / "work", symlinks=True)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


async def _host_process(argv: list[str], env: dict[str, str], payload: str, cwd: str | None, timeout_s: float,
                        who: str) -> str:
    """Run ``argv`` on the host in its own process group (killed whole at the timeout); its stdout."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(payload.encode()), timeout_s)
    except BaseException:
        _kill_group(proc.pid)
        await proc.wait()
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"{who} exited {proc.returncode}: {tail[0][:300]}")
    return out.decode(errors="replace")


async def _in_thread(fn: Callable[[], Any], cancel: Callable[[], None]) -> Any:
    """``fn()`` on a thread of its own (a sandbox dies with the thread that started it, so no pool's thread may
    start one), awaited; a cancelled await calls ``cancel`` (which must make ``fn`` return soon)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if not done.done():
            if exc is not None:
                done.set_exception(exc)
            else:
                done.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the loop is gone: nobody waits any more

    threading.Thread(target=target, name="agent-sandbox", daemon=True).start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        cancel()
        raise


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
