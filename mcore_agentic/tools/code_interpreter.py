"""``PythonCodeTool``: run the model's Python in a sandbox and report what happened as the observation.

Execution is :mod:`mcore_agentic.tools.sandbox`: by default a bubblewrap
sandbox per call (own user, PID, network, IPC and mount namespaces; uid 65534,
no capabilities; read-only interpreter; a size-capped tmpfs working directory;
a seccomp filter; resource limits), killed with every process it started when
the call ends. The tool refuses to start where no working ``bwrap`` exists
unless its config says ``sandbox: unsafe_subprocess``. The guarantees and how
to check them are in docs/tools_and_interactions.md.

``site_packages: true`` (default) lets the code import installed packages
(numpy, sympy, ...); ``false`` runs ``python -S`` with the standard library only.
"""

from __future__ import annotations

import re
from typing import Any

from mcore_agentic.tools.base import BaseTool, ToolResponse, error_response
from mcore_agentic.tools.sandbox import ExecutionResult, SandboxLimits, get_sandbox, run_sandboxed
from mcore_agentic.utils.walk import build

__all__ = ["ExecutionResult", "PythonCodeTool", "SandboxLimits", "format_observation", "strip_code_fence"]

_FENCE = re.compile(r"^\s*```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL | re.IGNORECASE)


_SIGNAL_HINTS = {
    "SIGXCPU": "CPU time limit exceeded",
    "SIGKILL": "killed (CPU time or memory limit)",
    "SIGXFSZ": "output/file size limit exceeded",
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "aborted",
}


def format_observation(result: ExecutionResult, limits: SandboxLimits) -> str:
    """The text the model reads: its output, then what went wrong, if anything."""
    parts: list[str] = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"Error: execution timed out after {limits.timeout_s:g} s and was stopped.")
    elif result.output_limit_exceeded:
        parts.append(f"Error: the output passed {limits.max_file_mb:g} MB and the execution was stopped.")
    elif result.signal_name is not None:
        hint = _SIGNAL_HINTS.get(result.signal_name, "terminated by a signal")
        parts.append(f"Error: the process was killed by {result.signal_name} ({hint}).")
    elif result.exit_code not in (0, None):
        parts.append(f"(exit code {result.exit_code})")
    if not parts:
        parts.append("(no output; use print() to show results)")
    return "\n".join(parts)


def strip_code_fence(code: str) -> str:
    """Models often wrap code in a markdown fence; run what is inside."""
    match = _FENCE.match(code)
    return match.group(1) if match else code


class PythonCodeTool(BaseTool):
    """Run Python code; parameters ``{"code": str}``. Output, errors and timeouts come back as the observation.

    Execution goes through ``self.executor`` (the rollout's local pool or
    Ray), so the event loop keeps serving other requests meanwhile.
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        super().__init__(config, tool_schema)
        self.limits: SandboxLimits = build(SandboxLimits, self.config, path="config")
        get_sandbox(self.limits)  # checks bwrap works here (one-line ConfigError if not) and boots the warm pool

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str) or not code.strip():
            return error_response(f"Error: tool '{self.name}' needs a non-empty string argument 'code'.", bad_call=1)
        code = strip_code_fence(code)
        try:
            # The child is killed after timeout_s; the extra margin only covers start-up and clean-up.
            result = await self.run_blocking(run_sandboxed, code, self.limits, timeout=self.limits.timeout_s + 30.0)
        except TimeoutError:
            return error_response(f"Error: execution timed out after {self.limits.timeout_s:g} s and was stopped.", timeout=1)
        except Exception as exc:  # noqa: BLE001 -- e.g. the interpreter could not start: still an observation
            return error_response(f"Error: could not run the code: {type(exc).__name__}: {exc}", exception=1)
        failed = result.timed_out or result.signal_name is not None or result.exit_code != 0
        metrics = {
            "exit_code": -1 if result.exit_code is None else result.exit_code,
            "timed_out": int(result.timed_out),
            "duration_s": result.duration_s,
            "sandboxed": int(result.isolation == "bwrap"),
        }
        return ToolResponse(text=format_observation(result, self.limits), metrics=metrics, is_error=failed)
