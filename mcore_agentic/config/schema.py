"""``RLConfig``: the run's config tree, composed from the dataclasses each package owns.

=============  =========================================  ==========================
YAML group     dataclass                                   owner
=============  =========================================  ==========================
``model``      :class:`~mcore_agentic.models.config.ModelConfig`        models
``data``       :class:`~mcore_agentic.data.config.DataConfig`           data
``actor``      :class:`~mcore_agentic.workers.config.ActorConfig`       workers (+ parallel, algorithms, flattened)
``ref``        :class:`~mcore_agentic.workers.config.RefConfig`         workers
``teacher``    :class:`~mcore_agentic.workers.config.TeacherConfig`     workers
``critic``     :class:`~mcore_agentic.workers.config.CriticConfig`      workers (+ algorithms, flattened)
``rollout``    :class:`~mcore_agentic.rollout.config.RolloutConfig`     rollout
``algorithm``  :class:`~mcore_agentic.algorithms.config.AlgorithmConfig` algorithms
``reward``     :class:`~mcore_agentic.rewards.config.RewardConfig`      rewards
``sharding``   :class:`~mcore_agentic.sharding.config.ShardingConfig`   sharding
``trainer``    :class:`~mcore_agentic.trainer.config.TrainerConfig`     trainer
=============  =========================================  ==========================

A package that adds a group adds its field here, regenerates
``configs/ppo_trainer.yaml`` and ``docs/configuration.md`` with
``launch/dump_config_reference.py`` and, if it interacts with other groups, adds
a rule in :mod:`mcore_agentic.config.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import ClassVar

from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.config.key_hints import suggest_key
from mcore_agentic.data.config import DataConfig
from mcore_agentic.models.config import ModelConfig
from mcore_agentic.rewards.config import RewardConfig
from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.sharding.config import ShardingConfig
from mcore_agentic.trainer.config import TrainerConfig
from mcore_agentic.utils.errors import require
from mcore_agentic.utils.walk import KeyHint, leaf_paths
from mcore_agentic.workers.config import ActorConfig, CriticConfig, RefConfig, TeacherConfig


@dataclass(frozen=True)
class RLConfig:
    """The whole run: one frozen tree, built once by :func:`mcore_agentic.config.load_config`."""

    model: ModelConfig
    """The Hugging Face checkpoint trained as actor (and loaded as reference/critic body)."""
    seed: int = 1
    """Global seed: python/numpy/torch RNGs, data shuffling, Megatron's model-parallel RNG."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data and the number of prompts per step."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy: parallel layout, PPO batch sizes, policy loss, optimizer."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy used for KL."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The frozen teacher of on-policy distillation (``algorithm.distillation``); off while ``model_path`` is empty."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (used when the advantage estimator needs values, i.e. GAE)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Engine, sampling, samples per prompt and multi-turn tool use."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, discounting and KL in the reward."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Which reward function scores finished responses (built-in rules by data_source, or a custom one)."""
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """Weight sync into the rollout engine (bucket size, version check, transport)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, logging, validation, checkpoints and resume."""

    unknown_key_hint: ClassVar[KeyHint] = staticmethod(suggest_key)
    """How an unknown key of the run's tree is answered: verl's names and retired keys (:mod:`.key_hints`)."""

    def __post_init__(self) -> None:
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")


@cache
def native_leaves() -> frozenset[str]:
    """Every dotted leaf key of the tree (``actor.optim.lr`` ...)."""
    return frozenset(leaf_paths(RLConfig))


@cache
def native_groups() -> frozenset[str]:
    """Every dotted group above a leaf (``actor``, ``actor.optim`` ...)."""
    return frozenset(".".join(p.split(".")[:i]) for p in native_leaves() for i in range(1, p.count(".") + 1))
