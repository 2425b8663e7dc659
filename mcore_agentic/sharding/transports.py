"""How exported buckets reach the rollout engine: one class per transport behind :class:`WeightTransport`.

A transport takes the stream of HF-named buckets (see :mod:`mcore_agentic.sharding.exporter`),
delivers them to one engine and completes the sync with ``finish_weight_update(version)``,
after which the engine reports ``weight_version == version``. Add a transport (from disk,
over NCCL to a remote engine) as another subclass and a name in :data:`TRANSPORTS`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from mcore_agentic.config.errors import ConfigError
from mcore_agentic.sharding.exporter import HFBucket


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


__all__ = ["SyncStats", "TRANSPORTS", "TensorTransport", "WeightTransport", "make_transport"]
