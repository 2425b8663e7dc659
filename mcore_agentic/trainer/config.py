"""The ``trainer`` config group: run length, logging, validation cadence, checkpoints and resume.

Key names follow verl (``trainer.total_epochs``, ``trainer.save_freq``,
``trainer.resume_mode``, ``trainer.default_local_dir`` ...). Light imports only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_agentic.utils.errors import require

LOGGER_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


def log_dir_of(log_dir: str | None, project_name: str, experiment_name: str) -> str:
    """``trainer.log_dir``, or its default ``outputs/<project_name>/<experiment_name>``."""
    return log_dir if log_dir is not None else f"outputs/{project_name}/{experiment_name}"


@dataclass(frozen=True)
class TrainerConfig:
    """How long to train, what to log where, when to validate and save, and how to resume."""

    project_name: str = "mcore_agentic"
    """Project name (log directory level and wandb project)."""
    experiment_name: str = "default"
    """Run name (log and checkpoint directory level, wandb run name)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks cuda when available."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_training_steps: int | None = None
    """Stop after this many steps (overrides total_epochs when set)."""
    sft_warmup_steps: int = 0
    """Supervised steps on demonstrations (the synthetic task's ideal conversations) before RL; 0 disables."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Tracking backends, any of console, jsonl, tensorboard, wandb."""
    log_freq: int = 1
    """Print the console summary table every this many steps."""
    log_dir: str | None = None
    """Where metrics.jsonl, TensorBoard events and the end-of-run plots go; null means
    outputs/<project_name>/<experiment_name>."""
    plot_at_end: bool = True
    """Save reward and response-length curves as PNG under log_dir when the run ends."""
    progress_bar: bool = True
    """Show a tqdm progress bar with ETA on rank 0."""
    val_before_train: bool = False
    """Validate once before the first step."""
    test_freq: int = -1
    """Validate every this many steps; -1 disables."""
    save_freq: int = -1
    """Save a checkpoint every this many steps; -1 saves only at the end of training when resuming is enabled."""
    default_local_dir: str | None = None
    """Checkpoint root holding global_step_<k>/ directories and latest_checkpointed_iteration.txt;
    null means checkpoints/<project_name>/<experiment_name>."""
    resume_mode: str = "auto"
    """auto: resume from the latest complete checkpoint under default_local_dir if any; disable: start fresh;
    resume_path: resume from resume_from_path; any other value is taken as a checkpoint directory path."""
    resume_from_path: str | None = None
    """Checkpoint directory (global_step_<k>) to resume from when resume_mode=resume_path."""
    resume_optim_from: Literal["checkpoint", "config"] = "checkpoint"
    """On resume, whose optimizer settings and learning-rate schedule win when the config changed since the
    checkpoint (lr, the decay floor: min_lr or min_lr_ratio, warmup, decay, weight decay, betas, eps): checkpoint
    keeps the saved run's (Megatron's default), config takes this run's, continuing from the saved step. Every
    changed key is listed at resume."""
    max_ckpt_to_keep: int | None = None
    """Keep only the newest this many checkpoints that pass a size check against their manifest (a damaged
    newer one never pushes out the last good one); null keeps all."""
    save_every_minutes: float | None = None
    """Also save after the first step that ends this many minutes after the last save (a safety net against
    crashes that send no signal); null disables."""
    checkpoint_verify: Literal["full", "size"] = "full"
    """Before resuming, check the checkpoint against its manifest: full re-hashes every byte (BLAKE3, split
    across ranks), size checks presence and sizes only (for very large checkpoints on slow filesystems)."""
    rollout_data_dir: str | None = None
    """Write per-trajectory dumps (parquet, one file per step and rollout group: messages, token ids, loss mask,
    rollout and trainer log-probs, advantages, reward parts, tool calls, timings) under this directory;
    null disables. Read them with ``python -m mcore_agentic.inspect DIR --out report.html``."""
    rollout_data_freq: int = 1
    """Dump the training rollouts of every this-many-th step (validation rollouts are dumped at every validation)."""
    rollout_data_fraction: float = 1.0
    """Fraction of each rollout group's training rows dumped per dump step (a seeded sample; at least one row);
    validation rollouts are dumped whole."""
    rollout_data_max_rows: int | None = None
    """At most this many rows per rollout group and dump (training and validation); null: no cap."""
    rollout_data_queue_size: int = 4
    """Dumps waiting for the background writer; when it is full the step waits rollout_data_wait_s, then drops
    that dump (a warning and dump/dropped_rows)."""
    rollout_data_wait_s: float = 10.0
    """Longest a step waits for a free slot in the dump queue before dropping its dump."""
    dist_timeout_minutes: int = 60
    """The longest any rank waits in a collective before it raises: ranks that finish their rollout early wait
    for the slowest in a host (gloo) call, so set it above your longest rollout plus a checkpoint save. It is
    also the NCCL watchdog's timeout for device calls."""
    plan_check: Literal["warn", "error", "off"] = "warn"
    """Before the workers start on GPUs, the launcher plans the run's memory per rank in each phase
    (``python -m mcore_agentic.plan``): ``warn`` prints the verdict, ``error`` refuses a run that does not fit in
    one line naming the phase, the rank and the shortfall, ``off`` skips it. CPU runs are not planned."""
    failure_stop_fraction: float = 0.9
    """A step fails when at least this fraction of its rollout requests failed, or called tools and had every call
    raise or time out inside the tool (a model's malformed calls do not count: they are its to learn from)."""
    failure_stop_steps: int = 3
    """Stop the run (exit code 3, one line saying why) after this many consecutive failing steps: a run whose
    requests almost all fail trains on nothing. 0 allows it (the failure rates are still logged every step)."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that stop training gracefully: the current step finishes, every rank agrees, a checkpoint is
    written and every rank exits with code 75; the same signal again (3 s or more later) exits at once.
    Empty: signals keep their default action (a SIGTERM kills the run without a checkpoint)."""

    def __post_init__(self) -> None:
        require(self.dist_timeout_minutes >= 1, "trainer.dist_timeout_minutes", f"must be >= 1, got {self.dist_timeout_minutes}")
        for name in self.logger:
            require(
                name in LOGGER_BACKENDS,
                "trainer.logger",
                f"unknown backend {name!r}; choose from {', '.join(LOGGER_BACKENDS)}",
            )
        require(len(set(self.logger)) == len(self.logger), "trainer.logger", f"lists a backend twice: {self.logger}")
        require(self.total_epochs > 0, "trainer.total_epochs", f"must be positive, got {self.total_epochs}")
        require(
            self.total_training_steps is None or self.total_training_steps > 0,
            "trainer.total_training_steps",
            f"must be positive or null, got {self.total_training_steps}",
        )
        require(self.sft_warmup_steps >= 0, "trainer.sft_warmup_steps", f"must be >= 0, got {self.sft_warmup_steps}")
        require(self.log_freq > 0, "trainer.log_freq", f"must be positive, got {self.log_freq}")
        require(self.test_freq == -1 or self.test_freq > 0, "trainer.test_freq", f"must be positive or -1, got {self.test_freq}")
        require(self.save_freq == -1 or self.save_freq > 0, "trainer.save_freq", f"must be positive or -1, got {self.save_freq}")
        require(
            self.max_ckpt_to_keep is None or self.max_ckpt_to_keep > 0,
            "trainer.max_ckpt_to_keep",
            f"must be positive or null, got {self.max_ckpt_to_keep}",
        )
        require(
            self.save_every_minutes is None or self.save_every_minutes > 0,
            "trainer.save_every_minutes",
            f"must be positive or null, got {self.save_every_minutes}",
        )
        require(
            self.checkpoint_verify in ("full", "size"),
            "trainer.checkpoint_verify",
            f"{self.checkpoint_verify!r} is not supported: use full or size",
        )
        require(self.rollout_data_freq > 0, "trainer.rollout_data_freq", f"must be positive, got {self.rollout_data_freq}")
        require(
            0.0 < self.rollout_data_fraction <= 1.0,
            "trainer.rollout_data_fraction",
            f"must be in (0, 1], got {self.rollout_data_fraction}",
        )
        require(
            self.rollout_data_max_rows is None or self.rollout_data_max_rows > 0,
            "trainer.rollout_data_max_rows",
            f"must be positive or null, got {self.rollout_data_max_rows}",
        )
        require(
            self.rollout_data_queue_size > 0,
            "trainer.rollout_data_queue_size",
            f"must be positive, got {self.rollout_data_queue_size}",
        )
        require(self.rollout_data_wait_s >= 0, "trainer.rollout_data_wait_s", f"must be >= 0, got {self.rollout_data_wait_s}")
        from mcore_agentic.trainer.preemption import parse_signals

        try:
            parse_signals(self.stop_signals)
        except ValueError as exc:
            require(False, "trainer.stop_signals", f"{exc}; list signal names such as [SIGTERM, SIGUSR1] or []")
        require(
            0.0 < self.failure_stop_fraction <= 1.0,
            "trainer.failure_stop_fraction",
            f"must be in (0, 1], got {self.failure_stop_fraction}",
        )
        require(self.failure_stop_steps >= 0, "trainer.failure_stop_steps", f"must be >= 0 (0 never stops), got {self.failure_stop_steps}")
        require(bool(self.resume_mode), "trainer.resume_mode", "must be auto, disable, resume_path or a checkpoint path")
        if self.resume_mode == "resume_path":
            require(
                bool(self.resume_from_path),
                "trainer.resume_from_path",
                "resume_mode=resume_path needs trainer.resume_from_path=<dir>/global_step_<k>",
            )

    @property
    def resolved_log_dir(self) -> str:
        return log_dir_of(self.log_dir, self.project_name, self.experiment_name)

    @property
    def checkpoint_dir(self) -> str:
        if self.default_local_dir is not None:
            return self.default_local_dir
        return f"checkpoints/{self.project_name}/{self.experiment_name}"
