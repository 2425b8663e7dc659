"""One training run on every rank: compose the config, build the run, train, summarise (:func:`run`).

A stop signal (``trainer.stop_signals``) ends it with :class:`~.preemption.TrainingStopped` after the checkpoint; the
launcher turns that into exit code 75.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What :func:`run` reports (identical on every rank, printed by rank 0)."""

    steps: int
    seconds: float
    first_rewards: list[float]
    last_rewards: list[float]
    artefacts: dict[str, str] = field(default_factory=dict)
    val_accuracy: list[tuple[int, float]] = field(default_factory=list)
    """(step, greedy validation accuracy) of every validation; step 0 is the warm-started policy."""
    nothing_to_do: bool = False
    """The run was already complete at its checkpoint: nothing was trained."""
    notes: list[str] = field(default_factory=list)
    """What the run left out or what failed: prompts dropped for length, failure totals, failing tools."""

    @property
    def first_mean(self) -> float:
        return sum(self.first_rewards) / max(len(self.first_rewards), 1)

    @property
    def last_mean(self) -> float:
        return sum(self.last_rewards) / max(len(self.last_rewards), 1)

    def text(self) -> str:
        lines = [
            f"finished {self.steps} RL steps in {self.seconds:.1f}s",
            f"mean reward: first {len(self.first_rewards)} steps {self.first_mean:.3f} -> "
            f"last {len(self.last_rewards)} steps {self.last_mean:.3f}",
        ]
        if self.val_accuracy:
            (s0, a0), (s1, a1) = self.val_accuracy[0], self.val_accuracy[-1]
            first = "after the warm start (step 0)" if s0 == 0 else f"at step {s0}"
            lines.append(f"validation accuracy (greedy): {first} {a0:.3f} -> step {s1} {a1:.3f} ({a1 - a0:+.3f})")
        lines += self.notes
        lines += [f"{name}: {path}" for name, path in self.artefacts.items()]
        return "\n".join(lines)


def current_layout(cfg: Any) -> Any:
    """The run's :class:`ParallelLayout`: Megatron's groups if the launcher made them, else made here."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_agentic.config.rules import check_world_size
    from mcore_agentic.parallel.layout import (
        current_parallel_layout,
        init_distributed,
        initialize_parallel,
        select_device,
    )

    select_device(cfg.trainer.device)
    if parallel_state.model_parallel_is_initialized():
        return current_parallel_layout()
    init_distributed(cfg.trainer.dist_timeout_minutes)
    check_world_size(cfg.actor.parallel, dist.get_world_size())
    return initialize_parallel(cfg.actor.parallel, cfg.seed)  # on CPU: after megatron_patches.apply() (launch/, tests)


def _rewards_by_step(metrics_path: Path, history: list[float]) -> list[float]:
    from mcore_agentic.trainer.plot import read_metrics

    if metrics_path.is_file():
        rows = [r for r in read_metrics(metrics_path) if r["step"] >= 1 and isinstance(r.get("reward/mean"), float)]
        if rows:
            return [r["reward/mean"] for r in rows]
    return history


def _val_accuracy(metrics_path: Path) -> list[tuple[int, float]]:
    from mcore_agentic.trainer.plot import read_metrics

    if not metrics_path.is_file():
        return []
    rows = read_metrics(metrics_path)
    return [(int(r["step"]), float(r["val/reward/accuracy"])) for r in rows if isinstance(r.get("val/reward/accuracy"), float)]


def split_job(cfg: Any) -> Any:
    """Under ``rollout.placement=separate``, this rank's :class:`~mcore_agentic.parallel.job.JobSplit`, the job split
    here unless the launcher did; None for a colocated run."""
    if not cfg.rollout.separate:
        return None
    from mcore_agentic.parallel.job import init_job, job_split, split_from_env

    split = job_split()
    if split is None:
        split = split_from_env(cfg.rollout.rollout_ranks, cfg.rollout.tensor_model_parallel_size)
        init_job(split, cfg.trainer.dist_timeout_minutes)
    return split


def run(cfg: Any, layout: Any = None) -> RunSummary:
    """Train per ``cfg`` (an :class:`RLConfig` or a composed Hydra config) on every rank; return the summary.

    ``layout``: the launcher's :class:`ParallelLayout`; None makes (or reads) Megatron's groups here.
    """
    from mcore_agentic.config.load import load_config
    from mcore_agentic.config.rules import validate
    from mcore_agentic.config.schema import RLConfig
    from mcore_agentic.parallel import comm
    from mcore_agentic.parallel.layout import local_world_size
    from mcore_agentic.trainer.build import build_checkpoint_manager, build_components
    from mcore_agentic.trainer.logger import Tracker
    from mcore_agentic.trainer.loop import RLTrainer
    from mcore_agentic.trainer.plot import plot_curves
    from mcore_agentic.trainer.progress import StepProgress
    from mcore_agentic.trainer.resume_report import RunComplete
    from mcore_agentic.utils.walk import to_dict

    cfg = cfg if isinstance(cfg, RLConfig) else load_config(cfg)
    start = time.perf_counter()
    split = split_job(cfg)
    if split is not None and split.is_rollout:  # separate placement: this rank generates for the trainer's ranks
        from mcore_agentic.parallel.job import job_links
        from mcore_agentic.trainer.rollout_rank import serve_rollout_rank

        serve_rollout_rank(cfg, split, job_links())
        return RunSummary(steps=0, seconds=time.perf_counter() - start, first_rewards=[], last_rewards=[])
    layout = layout if layout is not None else current_layout(cfg)
    job_world = split.world_size if split is not None else layout.world_size
    sizes = validate(cfg, job_world, local_world_size=local_world_size(job_world))
    components = build_components(cfg, layout, sizes)
    tracker = Tracker.from_config(cfg.trainer, config=to_dict(cfg))
    rank0 = layout.rank == 0

    def progress(total: int, initial: int) -> StepProgress:
        return StepProgress(total, initial_step=initial, enabled=cfg.trainer.progress_bar and rank0)

    trainer = RLTrainer(components, tracker, build_checkpoint_manager(cfg), progress)
    complete: RunComplete | None = None
    try:
        state = trainer.fit()
    except RunComplete as exc:  # a finished run launched again: say so instead of reprinting its summary
        complete, state = exc, trainer.state
    finally:
        # The feed: queued trajectory dumps reach the disk (also when a signal stopped the run), paused requests
        # release their tools, the tool executor and the engine stop (vLLM tears down its process groups: while
        # the trainer's world still exists).
        trainer.close()
        tracker.close()
        if split is not None and rank0:  # a rollout group's other ranks wait for this
            from mcore_agentic.trainer.rollout_rank import mark_job_end

            mark_job_end()
    if complete is not None:
        comm.barrier()
        if rank0:
            print(str(complete), flush=True)
        return RunSummary(steps=complete.step, seconds=time.perf_counter() - start, first_rewards=[], last_rewards=[],
                          nothing_to_do=True)
    log_dir = Path(cfg.trainer.resolved_log_dir)
    metrics_path = log_dir / "metrics.jsonl"
    artefacts: dict[str, str] = {}
    if rank0:
        if metrics_path.is_file():
            artefacts["metrics"] = str(metrics_path)
            if cfg.trainer.plot_at_end:
                for png in plot_curves(metrics_path, log_dir):
                    artefacts[png.stem] = str(png)
        if (log_dir / "tensorboard").is_dir():
            artefacts["tensorboard"] = str(log_dir / "tensorboard")
        dumps = cfg.trainer.rollout_data_dir
        if dumps is not None and Path(dumps).is_dir():
            artefacts["trajectories"] = f"{dumps} (python -m mcore_agentic.inspect {dumps} --out report.html)"
        if Path(cfg.trainer.checkpoint_dir).is_dir():
            artefacts["checkpoints"] = cfg.trainer.checkpoint_dir
    rewards = _rewards_by_step(metrics_path, state.history) if rank0 else state.history
    k = min(5, len(rewards))
    summary = RunSummary(
        steps=state.step,
        seconds=time.perf_counter() - start,
        first_rewards=rewards[:k],
        last_rewards=rewards[-k:] if k else [],
        artefacts=artefacts,
        val_accuracy=_val_accuracy(metrics_path) if rank0 else [],
        notes=[*components.feed.data_notes, *trainer.run_notes()],
    )
    comm.barrier()
    if rank0:
        print("\n" + "=" * 72 + "\n" + summary.text() + "\n" + "=" * 72, flush=True)
    return summary

