"""``ShardingManager``: the context around each rollout — weights into the engine, training state out of the way.

``with manager:`` (every rank of the actor's model, SPMD)

on enter
  1. offload the actor's gradient buffers and optimizer state (``sharding.offload_actor_grads``
     / ``offload_actor_optimizer``; the export does not need them);
  2. ``engine.resume_memory()``;
  3. stream the actor's weights into the engine in buckets (:class:`StreamingExporter` ->
     transport) under the trainer's :class:`WeightVersion`; every engine gets the *full* model
     whatever the training TP/PP/CP. The export is a collective over all ranks; a rank without
     an engine (``engine=None``: a rollout group's non-leader, see
     :mod:`mcore_agentic.parallel.rollout_placement`) joins it through :class:`NoEngine`;
  4. offload the actor's parameters (``offload_actor_params``; after the export read them);
  5. check the engine's version (``check_weight_version``); the engine's own
     ``finish_weight_update`` dropped whatever it cached under the old weights;
  6. swap the torch / Python / NumPy global RNG states to the rollout's own, so rollout
     sampling neither perturbs nor is perturbed by training randomness;

on exit (also after an error in the rollout)
  restore the training RNG states, ``engine.release_memory()``, reload what was offloaded.

The actor is a :class:`~mcore_agentic.workers.engine.MegatronEngine` (or an ``Actor``
holding one as ``.engine``), whose offloader moves parameters, grads and optimizer state;
or a plain list of model chunks plus a ``bridge`` (parameters and grads offloadable only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mcore_agentic.config.errors import ConfigError
from mcore_agentic.models.bridge import Bridge
from mcore_agentic.sharding.config import ShardingConfig
from mcore_agentic.sharding.exporter import StreamingExporter
from mcore_agentic.sharding.transports import SyncStats, WeightTransport, make_transport
from mcore_agentic.sharding.version import StaleWeightsError, WeightVersion
from mcore_agentic.utils.seeding import RngState
from mcore_agentic.workers.offload import Offloader, model_grad_tensors, model_param_tensors


class NoEngine:
    """The engine of a rank that holds none (a rollout group's non-leader): it joins the export's
    collectives like every rank, and a sync to it drops each bucket as it arrives."""

    def __init__(self) -> None:
        self.weight_version = 0

    def update_weights(self, named_tensors: Any, *, version: int) -> None:
        del named_tensors, version

    def finish_weight_update(self, version: int) -> None:
        self.weight_version = version

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def flush_cache(self) -> None: ...


@dataclass
class PhaseTimes:
    """Seconds spent in each step of the last enter/exit."""

    offload: float = 0.0
    resume: float = 0.0
    sync: float = 0.0
    release: float = 0.0
    reload: float = 0.0


class ShardingManager:
    """Puts the actor's current weights into the rollout engine for the duration of a ``with`` block."""

    def __init__(
        self,
        actor: Any,
        engine: Any,
        cfg: ShardingConfig,
        *,
        bridge: Bridge | None = None,
        version: WeightVersion | None = None,
        rollout_seed: int = 0,
        transport: WeightTransport | None = None,
    ) -> None:
        megatron_engine = getattr(actor, "engine", actor) if not isinstance(actor, (list, tuple)) else None
        if megatron_engine is not None and not hasattr(megatron_engine, "chunks"):
            raise TypeError(f"ShardingManager needs a MegatronEngine, an Actor or a list of model chunks, got {actor!r}")
        self._actor = megatron_engine
        chunks = list(actor) if megatron_engine is None else megatron_engine.chunks
        bridge = bridge if bridge is not None else getattr(megatron_engine, "bridge", None)
        if bridge is None:
            raise TypeError("ShardingManager over plain model chunks needs bridge=")
        if megatron_engine is None and cfg.offload_actor_optimizer:
            raise ConfigError(
                "sharding.offload_actor_optimizer",
                "needs the actor's MegatronEngine (its optimizer), not bare model chunks: pass the engine or set false",
            )
        self.cfg = cfg
        self.engine = engine if engine is not None else NoEngine()
        self.bridge = bridge
        self.chunks = chunks
        self.version = version if version is not None else WeightVersion()
        self.transport = transport if transport is not None else make_transport(cfg.transport)
        self.exporter = StreamingExporter(bridge, chunks, bucket_bytes=cfg.bucket_bytes, flat_gather=cfg.flat_gather)
        self._own_offloader = Offloader()  # used only for bare chunks
        self._rollout_rng = RngState.seeded(rollout_seed)
        self._training_rng: RngState | None = None
        self.last_sync: SyncStats | None = None
        self.times = PhaseTimes()
        self.offloaded_bytes = 0
        """Bytes the last ``with`` block moved off the device (0 without offload)."""

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> SyncStats:
        """Stream the actor's weights into the engine under the current version (collective)."""
        self.last_sync = self.transport.send(self.exporter.buckets(), self.engine, self.version.value)
        if int(self.engine.weight_version) != self.version.value:
            raise StaleWeightsError(int(self.engine.weight_version), self.version.value)
        return self.last_sync

    def check(self) -> None:
        """Raise :class:`StaleWeightsError` if the engine does not hold the trainer's current weights."""
        self.version.check(self.engine)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> ShardingManager:
        self.times = PhaseTimes()
        self.offloaded_bytes = 0
        try:
            t = time.perf_counter()
            self._ensure_params_loaded()
            self._offload(params=False, grads=self.cfg.offload_actor_grads, optimizer=self.cfg.offload_actor_optimizer)
            self.times.offload += time.perf_counter() - t
            t = time.perf_counter()
            self.engine.resume_memory()
            self.times.resume = time.perf_counter() - t
            t = time.perf_counter()
            self.sync_weights()
            self.times.sync = time.perf_counter() - t
            t = time.perf_counter()
            self._offload(params=self.cfg.offload_actor_params, grads=False, optimizer=False)
            self.times.offload += time.perf_counter() - t
            if self.cfg.check_weight_version:
                self.check()
        except BaseException:
            # Leave things as before the rollout: engine released, actor trainable.
            try:
                self.engine.release_memory()
            finally:
                self._reload()
            raise
        self._training_rng = RngState.capture()
        self._rollout_rng.restore()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._training_rng is not None:
            self._rollout_rng = RngState.capture()  # the next rollout continues this stream
            self._training_rng.restore()
            self._training_rng = None
        t = time.perf_counter()
        self.engine.release_memory()
        self.times.release = time.perf_counter() - t
        t = time.perf_counter()
        self._reload()
        self.times.reload = time.perf_counter() - t

    # ------------------------------------------------------------------ offload
    def _ensure_params_loaded(self) -> None:
        # The export reads the parameters: bring them back if the trainer left them offloaded.
        if self._actor is not None and self._actor.offloader.is_offloaded("params"):
            self._actor.offloader.reload("params")

    def _offload(self, *, params: bool, grads: bool, optimizer: bool) -> None:
        if not (params or grads or optimizer):
            return
        if self._actor is not None:
            self.offloaded_bytes += self._actor.offload(params=params, grads=grads, optimizer=optimizer)
            return
        own = self._own_offloader
        if params and not own.is_offloaded("params"):
            self.offloaded_bytes += own.offload("params", model_param_tensors(self.chunks))
        if grads and not own.is_offloaded("grads"):
            self.offloaded_bytes += own.offload("grads", model_grad_tensors(self.chunks))

    def _reload(self) -> None:
        if self._actor is not None:
            self._actor.reload()
        for group in ("params", "grads"):
            if self._own_offloader.is_offloaded(group):
                self._own_offloader.reload(group)


__all__ = ["NoEngine", "PhaseTimes", "RngState", "ShardingManager"]
