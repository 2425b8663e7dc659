"""``ShardingConfig``: how the trainer's weights reach the rollout engine, and what is offloaded meanwhile.

Light imports only (dataclasses): the config tree composes this group as ``sharding``.
Errors name ``sharding.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_agentic.config.errors import ConfigError

TRANSPORTS = ("tensor",)
"""Transport names :func:`mcore_agentic.sharding.transports.make_transport` knows."""


@dataclass(frozen=True)
class ShardingConfig:
    """Weight sync (Megatron shards -> engine) and the memory choreography around each rollout."""

    bucket_size_mb: float = 512.0
    """Peak extra memory (MiB) the export may hold besides the largest single tensor: weights are
    gathered, converted to engine (HF) layout and sent in buckets no larger than this. Bigger buckets
    mean fewer collectives; smaller ones less memory. See :mod:`mcore_agentic.sharding.exporter`."""

    flat_gather: bool = False
    """Gather each bucket with one flat all-gather over TP and one broadcast per owning PP stage
    instead of two collectives per tensor. It costs two extra copies of the bucket, and the flat
    buffer is part of the budget (a flat bucket carries about half of ``bucket_size_mb`` of weights);
    it pays only where per-collective latency dominates (many small tensors). Measured on CPU/gloo
    (``bench/weight_sync.py``, 246M params, TP=2) per-tensor was faster at 16/64/256 MiB buckets."""

    offload_actor_params: bool = False
    """Move the actor's parameters off the device while the rollout runs (after they were exported)."""

    offload_actor_grads: bool = False
    """Move the actor's DDP gradient buffers off the device while the rollout runs."""

    offload_actor_optimizer: bool = False
    """Move the actor's optimizer state (Adam moments, fp32 main params) off the device while the rollout runs."""

    check_weight_version: bool = True
    """Before each rollout, raise ``StaleWeightsError`` when the engine's weight version is not the trainer's."""

    transport: str = "tensor"
    """How buckets reach the engine: ``tensor`` (in-process ``engine.update_weights``; HF and SGLang engines)."""

    def __post_init__(self) -> None:
        size = self.bucket_size_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ConfigError("sharding.bucket_size_mb", f"must be a number > 0 (MiB), got {size!r}")
        for name in (
            "flat_gather", "offload_actor_params", "offload_actor_grads", "offload_actor_optimizer",
            "check_weight_version",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"sharding.{name}", f"must be true or false, got {getattr(self, name)!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                "sharding.transport", f"unknown transport {self.transport!r}: use one of {', '.join(TRANSPORTS)}"
            )

    @property
    def bucket_bytes(self) -> int:
        """``bucket_size_mb`` in bytes."""
        return int(self.bucket_size_mb * 1024 * 1024)

    @property
    def offloads_anything(self) -> bool:
        return self.offload_actor_params or self.offload_actor_grads or self.offload_actor_optimizer
