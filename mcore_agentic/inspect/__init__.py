"""Look at trajectories: ``python -m mcore_agentic.inspect DUMP_DIR --out report.html`` (see :mod:`.report`)."""

from mcore_agentic.inspect.report import build_report, step_summary, write_report

__all__ = ["build_report", "step_summary", "write_report"]
