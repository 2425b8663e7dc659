"""The ``data`` config group: where prompts come from and how many go into a step.

Key names follow verl (``data.train_files``, ``data.train_batch_size``,
``data.max_prompt_length`` ...). Light imports only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_agentic.utils.errors import require

SYNTHETIC_TASKS = ("tool_arith", "meter_reading", "meter_pair")


@dataclass(frozen=True)
class SyntheticTaskConfig:
    """Generated tool tasks for CPU runs: ``meter_reading`` (the embedded default), ``meter_pair`` (two meters, a
    multi-step episode where turn-level credit can matter) or ``tool_arith``."""

    enable: bool = False
    """Generate prompts in memory instead of reading ``data.train_files``."""
    task: str = "tool_arith"
    """``meter_reading``: read a meter only the tool knows (``read_meter``), reply ``#### <reading>``;
    ``meter_pair``: read two meters in turn (``read_meter`` twice), reply ``#### <first><second>`` (e.g. ``#### 4712``);
    ``tool_arith``: compute A + B with the calculator, reply ``#### <sum>``."""
    demo_round_fraction: float = 0.0
    """meter_reading: the fraction of warm-start demonstrations whose answer rounds the reading down to
    tens (``#### 40`` for 47): an imperfect teacher. Imitation learns the habit; the reward (exact reading)
    does not pay for it. meter_pair: the fraction that read only the first meter and repeat its reading
    (``#### 4747``)."""
    num_train: int = 512
    """Training problems to generate."""
    num_val: int = 64
    """Validation problems to generate (tool_arith: operand pairs disjoint from the training ones; meter_reading:
    fresh readings, drawn like the training ones)."""
    min_operand: int = 10
    """Smallest operand (tool_arith) or meter reading (meter_reading). With 10..49 every operand and every sum has two digits, so copying the
    operands into the tool call and the result into the answer is a fixed-offset copy a tiny model learns."""
    max_operand: int = 49
    """Largest operand (tool_arith) or meter reading (meter_reading)."""
    seed: int = 1234
    """Seed of the generator; the same seed gives the same problems."""

    def __post_init__(self) -> None:
        require(self.task in SYNTHETIC_TASKS, "data.synthetic.task", f"{self.task!r} is not one of {', '.join(SYNTHETIC_TASKS)}")
        require(
            0.0 <= self.demo_round_fraction <= 1.0,
            "data.synthetic.demo_round_fraction",
            f"must be in [0, 1], got {self.demo_round_fraction}",
        )
        require(
            self.task in ("meter_reading", "meter_pair") or self.demo_round_fraction == 0.0,
            "data.synthetic.demo_round_fraction",
            f"only the meter tasks have an imperfect teacher; set it to 0 for task={self.task}",
        )
        require(self.num_train > 0, "data.synthetic.num_train", f"must be positive, got {self.num_train}")
        require(self.num_val >= 0, "data.synthetic.num_val", f"must be >= 0, got {self.num_val}")
        require(self.min_operand >= 0, "data.synthetic.min_operand", f"must be >= 0, got {self.min_operand}")
        require(
            self.max_operand >= self.min_operand,
            "data.synthetic.max_operand",
            f"{self.max_operand} is below data.synthetic.min_operand={self.min_operand}",
        )
        distinct = (self.max_operand - self.min_operand + 1) ** 2
        require(
            self.task != "tool_arith" or
            distinct >= self.num_train + self.num_val,
            "data.synthetic.max_operand",
            f"operands {self.min_operand}..{self.max_operand} give only {distinct} distinct problems, fewer than "
            f"num_train + num_val = {self.num_train + self.num_val}; widen the range or generate fewer",
        )


@dataclass(frozen=True)
class DataConfig:
    """Prompt data for RL: parquet files (or the synthetic task) and per-step batch size."""

    train_files: str | list[str] = field(default_factory=list)
    """Parquet file(s) of training prompts (rows: prompt, data_source, ability, reward_model, extra_info)."""
    val_files: str | list[str] = field(default_factory=list)
    """Parquet file(s) of validation prompts; empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the chat messages [{role, content}, ...]."""
    train_batch_size: int = 16
    """Prompts per training step (each is rolled out ``rollout.n`` times)."""
    val_batch_size: int | None = None
    """Prompts per validation batch; null means the whole validation set at once."""
    max_prompt_length: int = 128
    """Longest prompt in tokens after the chat template (tool schemas included)."""
    max_response_length: int = 128
    """Token budget for everything after the prompt: all assistant turns, tool results and user turns."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than ``max_prompt_length`` at load time (the count is reported); false makes an
    overlong prompt an error naming its row (prompts are never truncated: a cut prompt changes the task)."""
    shuffle: bool = True
    """Shuffle the training set each epoch (seeded by the run's ``seed`` and the epoch)."""
    drop_last: bool = True
    """Drop the last incomplete batch of an epoch (a step always has ``train_batch_size`` prompts)."""
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    """Generated task for the CPU quick start; when enabled, ``train_files``/``val_files`` must be empty."""

    def __post_init__(self) -> None:
        require(self.train_batch_size > 0, "data.train_batch_size", f"must be positive, got {self.train_batch_size}")
        require(
            self.val_batch_size is None or self.val_batch_size > 0,
            "data.val_batch_size",
            f"must be positive or null, got {self.val_batch_size}",
        )
        require(self.max_prompt_length > 0, "data.max_prompt_length", f"must be positive, got {self.max_prompt_length}")
        require(
            self.max_response_length > 0, "data.max_response_length", f"must be positive, got {self.max_response_length}"
        )
        # "No data at all" is checked by the run's validate(): the dataclass default stays constructible.
        require(
            not (self.synthetic.enable and (self.train_file_list or self.val_file_list)),
            "data.synthetic.enable",
            "the synthetic task replaces train_files/val_files; set data.train_files=[] data.val_files=[] "
            "or data.synthetic.enable=false",
        )

    @property
    def train_file_list(self) -> list[str]:
        return [self.train_files] if isinstance(self.train_files, str) else list(self.train_files)

    @property
    def val_file_list(self) -> list[str]:
        return [self.val_files] if isinstance(self.val_files, str) else list(self.val_files)

    @property
    def max_sequence_length(self) -> int:
        """Prompt plus response budget: the longest sequence a worker sees."""
        return self.max_prompt_length + self.max_response_length
