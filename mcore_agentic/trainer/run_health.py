"""Is the run training on anything? Per-step failure rates, the stop rule and the end-of-run failure lines.

A step *fails* when at least ``trainer.failure_stop_fraction`` of its rollout requests failed or were *tool-broken*:
they called tools and every call was a fault of the tool (an exception raised inside it, or its timeout; a model's
malformed or unknown calls are not the tool's fault). Counting requests, not calls, keeps a rare timed-out call
from stopping a healthy run. ``trainer.failure_stop_steps`` consecutive failing steps end the run with
:class:`RunFailed` (the launcher prints its one line and exits 3); 0 never stops. Every rank holds the same
all-reduced counts, so every rank takes the same decision at the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.rollout.failures import is_tool_fault

__all__ = ["RunFailed", "RunHealth", "StepFailures", "describe", "is_tool_fault"]


class RunFailed(RuntimeError):
    """The run stopped because its rollouts almost all failed; the message is the one line that says why."""


@dataclass
class StepFailures:
    """One step's all-reduced counts."""

    requests: float
    failed_requests: float
    tool_calls: float
    tool_faults: float
    tool_broken_requests: float = 0.0

    @classmethod
    def from_metrics(cls, m: Mapping[str, Any]) -> StepFailures:
        return cls(
            requests=float(m.get("rollout/num_sequences", 0.0)),
            failed_requests=float(m.get("rollout/failed_requests", 0.0)),
            tool_calls=float(m.get("rollout/tool_calls", 0.0)),
            tool_faults=float(m.get("rollout/tool_faults", 0.0)),
            tool_broken_requests=float(m.get("rollout/tool_broken_requests", 0.0)),
        )

    @property
    def failed_fraction(self) -> float:
        return self.failed_requests / self.requests if self.requests else 0.0

    @property
    def unusable_fraction(self) -> float:
        """Requests that failed or were tool-broken, over all."""
        return (self.failed_requests + self.tool_broken_requests) / self.requests if self.requests else 0.0

    @property
    def tool_fault_fraction(self) -> float:
        return self.tool_faults / self.tool_calls if self.tool_calls else 0.0


@dataclass
class RunHealth:
    """Consecutive failing steps and the run's totals (``trainer.failure_stop_fraction`` / ``failure_stop_steps``)."""

    stop_fraction: float = 0.9
    stop_steps: int = 3
    streak: int = 0
    totals: StepFailures = field(default_factory=lambda: StepFailures(0.0, 0.0, 0.0, 0.0))

    def failing(self, s: StepFailures) -> bool:
        return s.requests > 0 and s.unusable_fraction >= self.stop_fraction

    def observe(self, step: int, s: StepFailures, why: str = "") -> None:
        """Count step ``step``; raise :class:`RunFailed` at the ``stop_steps``-th failing step in a row.

        ``why``: what the leaders' reports say (the tools and exception types), appended to the line.
        """
        t = self.totals
        self.totals = StepFailures(t.requests + s.requests, t.failed_requests + s.failed_requests,
                                   t.tool_calls + s.tool_calls, t.tool_faults + s.tool_faults,
                                   t.tool_broken_requests + s.tool_broken_requests)
        self.streak = self.streak + 1 if self.failing(s) else 0
        if self.stop_steps and self.streak >= self.stop_steps:
            raise RunFailed(
                f"stopped after step {step}: {self.streak} steps in a row trained on almost nothing "
                f"({describe(s)}){'; ' + why if why else ''}. Fix the cause (the warnings above have the first "
                "traceback of each failing tool), or set trainer.failure_stop_steps=0 to train on anyway"
            )

    def summary_line(self) -> str | None:
        """The run's failure totals for the end-of-run summary (None when nothing failed)."""
        t = self.totals
        if not t.failed_requests and not t.tool_faults:
            return None
        return f"failures: {describe(t)}"


def describe(s: StepFailures) -> str:
    parts = []
    if s.requests:
        parts.append(f"{s.failed_requests:.0f} of {s.requests:.0f} requests failed ({s.failed_fraction:.0%})")
    if s.tool_broken_requests:
        parts.append(f"{s.tool_broken_requests:.0f} more had every tool call fail inside the tool")
    if s.tool_calls:
        parts.append(f"{s.tool_faults:.0f} of {s.tool_calls:.0f} tool calls raised or timed out in the tool "
                     f"({s.tool_fault_fraction:.0%})")
    return ", ".join(parts) or "no requests"
