"""The weight version shared by trainer and rollout engine: a stale engine is an error, never silent.

The trainer owns one :class:`WeightVersion`; it is bumped after every actor update
(:meth:`WeightVersion.bump`). A weight sync sends the current value and the engine records
it in ``finish_weight_update(version)``; before each rollout :meth:`WeightVersion.check`
compares the two and raises :class:`StaleWeightsError` naming both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class StaleWeightsError(RuntimeError):
    """The rollout engine holds other weights than the trainer's current policy."""

    def __init__(self, engine_version: int, trainer_version: int):
        self.engine_version = engine_version
        self.trainer_version = trainer_version
        super().__init__(
            f"rollout engine holds weight version {engine_version} but the trainer's policy is at version "
            f"{trainer_version}: sync the weights (ShardingManager) before generating"
        )


@dataclass
class WeightVersion:
    """A counter of actor updates; ``value`` is the version the engine must hold to roll out."""

    value: int = 0

    def bump(self) -> int:
        """Record one actor update; returns the new version."""
        self.value += 1
        return self.value

    def check(self, engine: Any) -> None:
        """Raise :class:`StaleWeightsError` unless ``engine.weight_version == value``."""
        engine_version = int(engine.weight_version)
        if engine_version != self.value:
            raise StaleWeightsError(engine_version, self.value)


__all__ = ["StaleWeightsError", "WeightVersion"]
