"""``ShardingConfig``: how the trainer's weights reach the rollout engine (what is offloaded meanwhile: verl's ``actor.*_offload``).

Light imports only (dataclasses): the config tree composes this group as ``sharding``.
Errors name ``sharding.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_agentic.utils.errors import ConfigError

TRANSPORTS = ("tensor",)
"""Transport names :func:`mcore_agentic.sharding.transports.make_transport` knows."""


@dataclass(frozen=True)
class ShardingConfig:
    """Weight sync (Megatron shards -> engine) around each rollout."""

    bucket_size_mb: float = 512.0
    """Peak extra memory (MiB) the export may hold besides the largest single tensor: weights are
    gathered, converted to engine (HF) layout and sent in buckets no larger than this. Bigger buckets
    mean fewer collectives; smaller ones less memory. See :mod:`mcore_agentic.sharding.exporter`."""

    check_weight_version: bool = True
    """Before each rollout, raise ``StaleWeightsError`` when the engine's weight version is not the trainer's."""

    transport: str = "tensor"
    """How buckets reach the engine: ``tensor`` (in-process ``engine.update_weights``; HF and SGLang engines)."""

    def __post_init__(self) -> None:
        size = self.bucket_size_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ConfigError("sharding.bucket_size_mb", f"must be a number > 0 (MiB), got {size!r}")
        if not isinstance(self.check_weight_version, bool):
            raise ConfigError("sharding.check_weight_version", f"must be true or false, got {self.check_weight_version!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                "sharding.transport", f"unknown transport {self.transport!r}: use one of {', '.join(TRANSPORTS)}"
            )

    @property
    def bucket_bytes(self) -> int:
        """``bucket_size_mb`` in bytes."""
        return int(self.bucket_size_mb * 1024 * 1024)
