"""Experiment tracking on rank 0: console table, JSONL, TensorBoard and (optionally) Weights & Biases.

``trainer.logger=[console,jsonl,tensorboard,wandb]`` picks the backends. Only the
process with rank 0 creates any of them; on other ranks :class:`Tracker` is a no-op,
so callers never branch on the rank.

* ``console``: a rich table of the step's metrics every ``trainer.log_freq`` steps;
* ``jsonl``: ``<log_dir>/metrics.jsonl``, one ``{"step": k, ...}`` line per step,
  flushed at once (the end-of-run plots and crash forensics read it);
* ``tensorboard``: ``<log_dir>/tensorboard`` scalars;

Before the first step the trainer calls :meth:`Tracker.continue_after` with the step it
continues after, so that every step appears exactly once:

* ``k > 0`` (resumed from step ``k``): the steps after ``k`` were logged by the interrupted
  run but will be trained again. ``metrics.jsonl`` is rewritten without them (and without a
  line torn by the kill), and TensorBoard reopens with ``purge_step=k+1``, which hides the old
  events of those steps.
* ``0`` (a fresh start, or a resume from the SFT warm start): an existing ``metrics.jsonl``
  belongs to an earlier run of this log directory. It is moved aside to
  ``metrics.<time>.jsonl``, nothing deleted, and TensorBoard purges from step 0.
* ``wandb``: imported only when selected; a clear error when it is not installed.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from mcore_agentic.trainer.metrics import numeric_metrics
from mcore_agentic.utils.errors import ConfigError

METRICS_FILE = "metrics.jsonl"


class Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _json_value(v: float) -> float | str:
    # JSON has no NaN/inf; strings keep them visible instead of failing the write.
    return v if math.isfinite(v) else str(v)


class JsonlBackend:
    """One JSON object per step, flushed immediately."""

    def __init__(self, log_dir: Path):
        self.path = log_dir / METRICS_FILE
        self._file = open(self.path, "a")

    def continue_after(self, step: int) -> None:
        """Keep only records of steps up to ``step`` (none for 0: the old file is moved aside), then append."""
        self._file.close()
        text = self.path.read_text(errors="replace") if self.path.is_file() else ""
        if step <= 0:
            if text.strip():
                aside = self.path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}.jsonl")
                os.replace(self.path, aside)
        else:
            kept = []
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                    kept.append(line)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(f"{line}\n" for line in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = log_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def continue_after(self, step: int) -> None:
        """Reopen with ``purge_step``: TensorBoard discards earlier events of steps after ``step`` (all for 0)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=step + 1 if step > 0 else 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, log_dir: Path, project: str, experiment: str, config: Mapping[str, Any] | None):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "trainer.logger",
                "wandb is selected but not installed: pip install wandb (or pip install -e '.[wandb]'), "
                "or remove wandb from trainer.logger",
            ) from None
        self._wandb = wandb
        self.run = wandb.init(project=project, name=experiment, config=dict(config or {}), dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class ConsoleBackend:
    """A rich table every ``every`` steps: metric groups (text before the first "/") as sections."""

    def __init__(self, every: int = 1, file: Any = None, width: int | None = None):
        from rich.console import Console

        self.every = every
        self.console = Console(file=file, width=width, highlight=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step % self.every:
            return
        from rich.table import Table

        table = Table(title=f"step {step}", show_header=True, header_style="bold", min_width=40)
        table.add_column("metric")
        table.add_column("value", justify="right")
        previous_group = None
        for key in sorted(metrics):
            group = key.split("/", 1)[0]
            if previous_group is not None and group != previous_group:
                table.add_section()
            previous_group = group
            table.add_row(key, f"{metrics[key]:.6g}")
        self.console.print(table)

    def close(self) -> None:
        pass


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class Tracker:
    """Fan step metrics out to the selected backends (rank 0 only)."""

    def __init__(
        self,
        backends: Sequence[str],
        log_dir: str | os.PathLike,
        *,
        project: str = "mcore_agentic",
        experiment: str = "default",
        config: Mapping[str, Any] | None = None,
        console_every: int = 1,
        rank: int | None = None,
        console_file: Any = None,
    ):
        self.rank = _rank() if rank is None else rank
        self.log_dir = Path(log_dir)
        self.backends: dict[str, Backend] = {}
        if self.rank != 0:
            return
        unknown = [b for b in backends if b not in ("console", "jsonl", "tensorboard", "wandb")]
        if unknown:
            raise ConfigError("trainer.logger", f"unknown backend {unknown[0]!r}; use console, jsonl, tensorboard, wandb")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (self.log_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        for name in backends:
            if name == "console":
                self.backends[name] = ConsoleBackend(console_every, file=console_file)
            elif name == "jsonl":
                self.backends[name] = JsonlBackend(self.log_dir)
            elif name == "tensorboard":
                self.backends[name] = TensorBoardBackend(self.log_dir)
            elif name == "wandb":
                self.backends[name] = WandbBackend(self.log_dir, project, experiment, config)

    @classmethod
    def from_config(cls, trainer_cfg: Any, config: Mapping[str, Any] | None = None, **kwargs: Any) -> Tracker:
        """A tracker for ``trainer`` settings (:class:`~mcore_agentic.trainer.config.TrainerConfig`)."""
        return cls(
            trainer_cfg.logger,
            trainer_cfg.resolved_log_dir,
            project=trainer_cfg.project_name,
            experiment=trainer_cfg.experiment_name,
            config=config,
            console_every=trainer_cfg.log_freq,
            **kwargs,
        )

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / METRICS_FILE

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log the numeric entries of ``metrics`` for ``step`` (python, numpy or 1-element torch values)."""
        if not self.backends:
            return
        values = numeric_metrics(metrics)
        for backend in self.backends.values():
            backend.log(values, step)

    def continue_after(self, step: int) -> None:
        """The run trains the steps after ``step`` (0: from the start): forget what was logged for them."""
        for backend in self.backends.values():
            forget = getattr(backend, "continue_after", None)
            if forget is not None:  # console and wandb keep what they showed
                forget(step)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends = {}

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
