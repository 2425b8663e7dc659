"""What failed in a rollout, from its collated meta: failed requests and tool errors, with their first tracebacks.

A rollout leader calls :func:`summarize_failures` on a step's ``Batch.meta`` (its ``request_metrics`` and
``tool_log``, see :func:`mcore_agentic.rollout.driver.collate`) and :meth:`FailureReport.log` to warn once per
failing tool and once for failed requests, each with the first traceback; :meth:`FailureReport.merge`
accumulates the run's reports for :meth:`FailureReport.summary_lines` at its end. A leaf: standard library only.

A tool *fault* is the tool's own failure: an exception raised inside it (its ``tool_log`` entry has a
``traceback``) or its timeout (``error_type == "TimeoutError"``). The model's bad calls (``malformed_call``,
``unknown_tool``, ``invalid_arguments``, ``too_many_calls``) and error observations a tool returns itself
(``tool_error``) are counted, never warned about: the model is there to learn from them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

UNNAMED_TOOL = "(unnamed)"
"""The tool name of a call the parser could not read a name from."""

MODEL_ERRORS = frozenset({"malformed_call", "unknown_tool", "invalid_arguments", "too_many_calls"})
"""``error_type`` of the model's own bad calls: counted, never a tool's failure."""


def is_tool_fault(entry: Mapping[str, Any]) -> bool:
    """A ``tool_log`` entry whose error is the tool's own: an exception raised inside it, or its timeout."""
    return bool(entry.get("traceback")) or entry.get("error_type") == "TimeoutError"


@dataclass
class FailureReport:
    """Counts of failed requests and tool errors, with the first traceback (or message) of each kind."""

    requests: int = 0
    failed_requests: int = 0
    request_errors: Counter[str] = field(default_factory=Counter)
    """Failed requests by exception type."""
    first_request_error: dict[str, str] = field(default_factory=dict)
    """Per exception type, the first failed request's traceback (its error line when it has none)."""
    tool_calls: int = 0
    calls_by_tool: Counter[str] = field(default_factory=Counter)
    tool_errors: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Tool calls that returned an error, by ``(tool name, error_type)``."""
    tool_faults: Counter[str] = field(default_factory=Counter)
    """Per tool, the errors that were the tool's own (:func:`is_tool_fault`)."""
    first_tool_fault: dict[str, str] = field(default_factory=dict)
    """Per tool, the first fault's traceback (the observation text of a timeout, which has none)."""

    @property
    def ok(self) -> bool:
        """No failed request and no tool error of any kind."""
        return not self.failed_requests and not self.tool_errors

    def merge(self, other: FailureReport) -> FailureReport:
        """Add ``other``'s counts to this report (first tracebacks already held are kept); returns ``self``."""
        self.requests += other.requests
        self.failed_requests += other.failed_requests
        self.request_errors.update(other.request_errors)
        self.tool_calls += other.tool_calls
        self.calls_by_tool.update(other.calls_by_tool)
        self.tool_errors.update(other.tool_errors)
        self.tool_faults.update(other.tool_faults)
        for mine, theirs in ((self.first_request_error, other.first_request_error),
                             (self.first_tool_fault, other.first_tool_fault)):
            for key, text in theirs.items():
                mine.setdefault(key, text)
        return self

    def errors_of(self, tool: str) -> Counter[str]:
        """``tool``'s errors by ``error_type``."""
        return Counter({kind: n for (name, kind), n in self.tool_errors.items() if name == tool})

    def summary_lines(self) -> list[str]:
        """Short lines, empty when all is well: failed requests; each tool whose own errors (faults, error
        observations it returned) there were, most first; then the model's bad calls in one line, whatever names it
        wrote (a tiny model's garbled calls must not make one line each).

        ``"tool calc_gsm8k_reward: 96/96 calls failed (ValueError x96)"``.
        """
        lines = []
        if self.failed_requests:
            lines.append(f"requests: {self.failed_requests}/{self.requests} failed ({_kinds(self.request_errors)})")
        own = Counter[str]()
        model = Counter[str]()
        for (name, kind), n in self.tool_errors.items():
            if kind in MODEL_ERRORS:
                model[kind] += n
            else:
                own[name] += n
        for name, n in sorted(own.items(), key=lambda kv: (-kv[1], kv[0])):
            kinds = {k: c for k, c in self.errors_of(name).items() if k not in MODEL_ERRORS}
            lines.append(f"tool {name}: {n}/{self.calls_by_tool[name]} calls failed ({_kinds(kinds)})")
        if model:
            lines.append(f"the model's own bad tool calls: {sum(model.values())} of {self.tool_calls} "
                         f"({_kinds(model)})")
        return lines

    def log(self, logger: logging.Logger, step: int, split: str) -> None:
        """One WARNING per tool with faults, with its first traceback; one for failed requests, with the first
        reason; nothing when neither happened (the model's bad calls are counted in :meth:`summary_lines` only)."""
        for name in sorted(self.tool_faults, key=lambda t: (-self.tool_faults[t], t)):
            errors = self.errors_of(name)
            logger.warning(
                "step %d (%s): tool %s: %d/%d calls failed (%s); the first:\n%s",
                step, split, name, sum(errors.values()), self.calls_by_tool[name], _kinds(errors),
                self.first_tool_fault.get(name, "(no traceback)"),
            )
        if self.failed_requests:
            kind = self.request_errors.most_common(1)[0][0]
            logger.warning(
                "step %d (%s): %d/%d rollout requests failed (%s); they train on nothing. The first %s:\n%s",
                step, split, self.failed_requests, self.requests, _kinds(self.request_errors), kind,
                self.first_request_error.get(kind, "(no traceback)"),
            )


def summarize_failures(meta: Mapping[str, Sequence[Any]]) -> FailureReport:
    """The :class:`FailureReport` of a collated rollout's meta (``request_metrics`` and ``tool_log``, one per row).

    Rows without metrics count as requests that did not fail; a missing ``tool_log`` as no tool calls.
    """
    report = FailureReport()
    for metrics in meta.get("request_metrics") or []:
        report.requests += 1
        metrics = metrics or {}
        if metrics.get("state") != "failed":
            continue
        report.failed_requests += 1
        error = str(metrics.get("error") or "")
        kind = metrics.get("error_type") or (error.split(":", 1)[0].strip() if ":" in error else "") or "unknown"
        report.request_errors[kind] += 1
        report.first_request_error.setdefault(kind, metrics.get("error_traceback") or error or "(no message)")
    for log in meta.get("tool_log") or []:
        for entry in log or []:
            name = str(entry.get("name") or UNNAMED_TOOL)
            report.tool_calls += 1
            report.calls_by_tool[name] += 1
            if not entry.get("error"):
                continue
            report.tool_errors[(name, str(entry.get("error_type") or "tool_error"))] += 1
            if is_tool_fault(entry):
                report.tool_faults[name] += 1
                report.first_tool_fault.setdefault(name, entry.get("traceback") or str(entry.get("result") or ""))
    return report


def _kinds(counts: Mapping[str, int]) -> str:
    """``"ValueError x96, TimeoutError x2"``, most frequent first."""
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
