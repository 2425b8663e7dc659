"""How exported buckets reach the rollout engine: one class per transport behind :class:`WeightTransport`.

A transport takes the stream of HF-named buckets (see :mod:`mcore_agentic.sharding.exporter`),
delivers them to one engine and completes the sync with ``finish_weight_update(version)``,
after which the engine reports ``weight_version == version``. Add a transport (from disk,
over NCCL to a remote engine) as another subclass and a name in :data:`TRANSPORTS`.

The weight version shared by trainer and rollout engine lives here too: a stale engine is an
error, never silent. The trainer owns one :class:`WeightVersion`, bumped after every actor
update; a sync sends the current value and the engine records it in
``finish_weight_update(version)``; before each rollout :meth:`WeightVersion.check` compares
the two and raises :class:`StaleWeightsError` naming both.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from mcore_agentic.sharding.exporter import HFBucket
from mcore_agentic.utils.errors import ConfigError


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


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved and how long it took."""

    version: int
    buckets: int
    tensors: int
    bytes: int
    seconds: float


class WeightTransport(ABC):
    """Delivers a sync's buckets to an engine and finishes the update."""

    name: ClassVar[str]

    @abstractmethod
    def send(self, buckets: Iterable[HFBucket], engine: Any, version: int) -> SyncStats:
        """Deliver every bucket to ``engine``, then ``finish_weight_update(version)``."""


class TensorTransport(WeightTransport):
    """In-process: ``engine.update_weights(bucket, version=v)`` per bucket (HFEngine; SGLang's
    ``update_weights_from_tensor``), then ``engine.finish_weight_update(v)``."""

    name = "tensor"

    def send(self, buckets: Iterable[HFBucket], engine: Any, version: int) -> SyncStats:
        start = time.perf_counter()
        n_buckets = n_tensors = n_bytes = 0
        for bucket in buckets:
            engine.update_weights(bucket, version=version)
            n_buckets += 1
            n_tensors += len(bucket)
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        engine.finish_weight_update(version)
        return SyncStats(version, n_buckets, n_tensors, n_bytes, time.perf_counter() - start)


TRANSPORTS: dict[str, type[WeightTransport]] = {TensorTransport.name: TensorTransport}


def make_transport(name: str) -> WeightTransport:
    """The transport called ``name`` (``sharding.transport``)."""
    if name not in TRANSPORTS:
        raise ConfigError("sharding.transport", f"unknown transport {name!r}: use one of {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]()


__all__ = ["StaleWeightsError", "SyncStats", "TRANSPORTS", "TensorTransport", "WeightTransport", "WeightVersion", "make_transport"]
