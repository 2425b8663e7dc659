"""Running one agent program for one sample: a Python entry point or a command line, with a timeout.

Whatever the program does, :func:`run_program` returns a :class:`ProgramOutcome`: the reward it gave (a number,
or a dict of reward parts whose ``score`` or ``reward`` is the reward and whose other numbers are logged), or
why it failed (it raised, exited non-zero, timed out, or returned something that is not a reward). It never
raises for the program's faults.
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
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
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
                      row: dict[str, Any], timeout_s: float) -> ProgramOutcome:
    """Run the entry point or the command for one sample (module docstring)."""
    try:
        if entry is not None:
            value = await asyncio.wait_for(_call(entry, access, row), timeout_s)
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
    payload = json.dumps(row, ensure_ascii=False, default=str)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="agent_row_", delete=False) as f:
        f.write(payload)
        row_file = f.name
    env = {**os.environ, "OPENAI_BASE_URL": access.base_url, "OPENAI_API_KEY": access.api_key,
           "ANTHROPIC_BASE_URL": access.anthropic_base_url, "ANTHROPIC_API_KEY": access.api_key,
           "MCORE_AGENTIC_ROW": row_file, "MCORE_AGENTIC_SESSION_ID": access.session_id}
    try:
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(command), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload.encode()), timeout_s)
        except BaseException:
            _kill_group(proc.pid)
            await proc.wait()
            raise
    finally:
        os.unlink(row_file)
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"the agent command exited {proc.returncode}: {tail[0][:300]}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise ValueError(f"the agent command's last stdout line is not a reward: {lines[-1][:200]!r}") from None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
