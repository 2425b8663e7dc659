"""What the feed reads of the run's config, in typed objects the trainer builds (:class:`FeedSettings`,
:class:`DumpSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_agentic.feed.fields import always_fields, select
from mcore_agentic.rewards.config import OverlongBufferConfig
from mcore_agentic.rollout.config import RolloutConfig


@dataclass(frozen=True)
class DumpSettings:
    """Trajectory dumps (``trainer.rollout_data_*``): where, how often, how much."""

    root: str
    freq: int
    fraction: float
    max_rows: int | None
    queue_size: int
    wait_s: float


@dataclass(frozen=True)
class FeedSettings:
    """What the feed reads of the run's config (built by the trainer from it, one place)."""

    rollout: RolloutConfig
    prompts_per_step: int
    """``data.train_batch_size``: prompt groups a step trains."""
    sequences_per_step: int
    mini_batch_sizes: tuple[int, ...]
    """The actor's (and critic's) mini-batch rows: the plan deals rows in chunks every mini-batch is made of."""
    plan_seed: int | None
    """The actor's shuffle seed (None: rows in order); each step's plan adds ``step * SEED_STRIDE``."""
    seed: int
    max_response_length: int
    overlong_buffer: OverlongBufferConfig
    val_batch_size: int | None
    filter_metric: str | None = None
    """``algorithm.filter_groups.metric`` when it is enabled."""
    max_num_gen_batches: int = 0
    dumps: DumpSettings | None = None
    fields: frozenset[str] = field(default_factory=always_fields)
    """The fields of the seam's table the rows carry (:func:`.fields.wanted_fields` of the run's config). Their
    producers run when they are wanted: scoring keeps each turn's reward at its turn (``turn_rewards``) and
    numbers each turn's state (``turn_states``); with ``episode_index`` a step's rows are counted after the
    rollout."""
    gigpo_state: str = "observation"
    """``algorithm.gigpo.state``: what a turn's state is, for the producer of ``turn_states``."""
    row_multiple: int = 1
    """With ``episodes``: the step's rows are padded (filler rows that train nothing) to a multiple of this — every
    mini-batch count's least common multiple times DP, so each mini-batch splits evenly over the replicas."""

    def __post_init__(self) -> None:
        select(self.fields)  # every name is the table's

    def wants(self, name: str) -> bool:
        """Whether the rows carry the table's field ``name``."""
        return name in self.fields

    @property
    def episodes(self) -> bool:
        """Agent programs whose forked episodes train every sample (``rollout.agent.train_samples=all``): a step's
        rows are counted after the rollout, and each carries its episode's id."""
        return self.wants("episode_index")
