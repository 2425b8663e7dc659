"""``ShardingManager``: the context around each rollout — weights into the engine, training state out of the way.

``with manager:`` (every rank of the actor's model, SPMD)

on enter (the order keeps the peak low: the KV cache, the engine's largest part, comes last)
  1. ``actor.offload_before_export()``: the actor's gradient buffers and optimizer state off the
     device as verl's ``actor.grad_offload`` / ``actor.optimizer_offload`` ask (the export does
     not read them), then the freed blocks back to the driver (:func:`return_cached_memory`);
     a host barrier;
  2. ``engine.resume_memory(["weights"])``;
  3. stream the actor's weights into the engine in buckets (:class:`StreamingExporter` ->
     transport) under the trainer's :class:`WeightVersion`; every engine gets the *full* model
     whatever the training TP/PP/CP. The export is a collective over all ranks; a rank without
     an engine (``engine=None``: a rollout group's non-leader, see
     :mod:`mcore_agentic.parallel.rollout_placement`) joins it through :class:`NoEngine`;
  4. ``actor.offload_after_export()``: its parameters too with ``actor.param_offload``, and the
     freed blocks back to the driver; a host barrier;
  5. ``engine.resume_memory(["kv_cache"])``;
  6. check the engine's version (``check_weight_version``); the engine's own
     ``finish_weight_update`` dropped whatever it cached under the old weights;
  7. swap the torch / Python / NumPy global RNG states to the rollout's own, so rollout
     sampling neither perturbs nor is perturbed by training randomness;

on exit (also after an error in the rollout)
  restore the training RNG states, ``engine.release_memory()`` and the freed blocks back to the
  driver, a host barrier (not after an error: see :meth:`ShardingManager.__exit__`), ``actor.reload()``.

Why the barriers: an engine may span other ranks' GPUs (an SGLang engine of rollout TP=k, launched by
its group's leader, runs schedulers on the GPUs of the group's k-1 other ranks), and the offloads and
the reload are each rank's own, with no collective between them and the leader's resume or release.
Without the barriers the leader could map the engine's weights or KV cache on GPU j while rank j still
holds its optimizer state or parameters, or rank j could reload while the engine's KV cache still
occupies its GPU (GPU review C1). They are :func:`comm.barrier` host calls over the world (gloo).

Why the device synchronisation: each phase is timed by :func:`~mcore_agentic.utils.timing.timer`, which
synchronises the device around it once CUDA is initialised, so ``timing_s/sharding/*`` include the
copies and kernels the phase queued (GPU review m4), and a rank's device-to-host copies are done before
it reaches the barrier that lets the leader map memory on its GPU.

Why the driver: what the trainer frees stays in torch's caching allocator, where neither SGLang's
processes nor vLLM's sleep-mode allocator (which maps memory outside it) can take it, and where
NVML still counts it as used (``gpu/freed_gb/*``).

The actor is any :class:`RolloutPolicy`: the trainer's
:class:`~mcore_agentic.workers.actor.Actor`, which decides what its config offloads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mcore_agentic.models.bridge import Bridge
from mcore_agentic.parallel import comm
from mcore_agentic.sharding.config import ShardingConfig
from mcore_agentic.sharding.exporter import StreamingExporter
from mcore_agentic.sharding.transports import (
    StaleWeightsError,
    SyncStats,
    WeightTransport,
    WeightVersion,
    make_transport,
)
from mcore_agentic.utils.seeding import RngState
from mcore_agentic.utils.timing import timer

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0
"""How long the release waits for an engine to finish aborting what it still generates (its ``drain``)."""


class ExportableModel(Protocol):
    chunks: list[Any]
    """This rank's Megatron model chunks."""
    bridge: Bridge


class RolloutPolicy(Protocol):
    """What the manager needs of the trained policy: its model, and its offload interface around a rollout."""

    model: ExportableModel

    def offload_before_export(self) -> int: ...

    def offload_after_export(self) -> int: ...

    def reload(self) -> int: ...


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

    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...

    def flush_cache(self) -> None: ...


def return_cached_memory() -> None:
    """Hand the blocks torch's CUDA caching allocator holds unused back to the driver (nothing before CUDA is
    initialised, e.g. on CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass
class PhaseTimes:
    """Seconds spent in each step of the last enter/exit."""

    offload: float = 0.0
    resume: float = 0.0
    sync: float = 0.0
    release: float = 0.0
    reload: float = 0.0
    wait: float = 0.0
    """At the barriers, for the other ranks."""


class ShardingManager:
    """Puts the actor's current weights into the rollout engine for the duration of a ``with`` block."""

    def __init__(
        self,
        actor: RolloutPolicy,
        engine: Any,
        cfg: ShardingConfig,
        *,
        version: WeightVersion | None = None,
        rollout_seed: int = 0,
        transport: WeightTransport | None = None,
    ) -> None:
        self.actor = actor
        self.cfg = cfg
        self.engine = engine if engine is not None else NoEngine()
        self.version = version if version is not None else WeightVersion()
        self.transport = transport if transport is not None else make_transport(cfg.transport)
        self.exporter = StreamingExporter(actor.model.bridge, actor.model.chunks, bucket_bytes=cfg.bucket_bytes)
        self._rollout_rng = RngState.seeded(rollout_seed)
        self._training_rng: RngState | None = None
        self.last_sync: SyncStats | None = None
        self.times = PhaseTimes()
        self.offloaded_bytes = 0
        """Bytes the last ``with`` block moved off the device (0 without offload)."""
        self.gpu: Any = None
        """Optional device-memory collector (:class:`~mcore_agentic.utils.gpu_metrics.GpuMetrics`): records the
        memory the actor's offload and the engine's release gave back (``gpu/freed_gb/*``)."""

    def _read_gpu(self) -> Any:
        return self.gpu.read() if self.gpu is not None else None

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Add the block's seconds to ``self.times.<phase>``, the device synchronised around it once CUDA is
        initialised (the models are on it; before that no device work can be queued, and CUDA is left alone)."""
        spent: dict[str, float] = {}
        with timer(phase, spent, sync=torch.cuda.is_initialized()):
            yield
        setattr(self.times, phase, getattr(self.times, phase) + spent[phase])

    def _barrier(self) -> None:
        """Wait for every rank (a gloo host call; nothing at world 1).

        Over the world, always, also where every engine is a rank's own (rollout TP=1): the manager is not
        told the rollout groups, the world holds every group an engine spans, and the barriers cost
        little. They are three one-integer gloo all-reduces a step. The first is followed by the export,
        a collective over all ranks that waits for the slowest anyway; the exit's follows the rollout's
        rounds table (a world collective), so it waits for what the leaders do after it, which the
        hand-off would wait for anyway. Only the second (before the KV cache) adds a wait: the engine
        wakes its KV cache once the slowest rank has offloaded its parameters, as one that spans
        several ranks' GPUs must.
        """
        with self._timed("wait"):
            comm.barrier()

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> SyncStats:
        """Stream the actor's weights into the engine under the current version (collective)."""
        self.last_sync = self.transport.send(self.exporter.buckets(), self.engine, self.version.value)
        if int(self.engine.weight_version) != self.version.value:
            raise StaleWeightsError(int(self.engine.weight_version), self.version.value)
        return self.last_sync

    def metrics(self) -> dict[str, float]:
        """Seconds of the last ``with`` block's phases (``timing_s/sharding/*``) and the MiB it offloaded."""
        out = {f"timing_s/sharding/{k}": float(v) for k, v in vars(self.times).items()}
        out["sharding/offloaded_mb"] = self.offloaded_bytes / 2**20
        return out

    def check(self) -> None:
        """Raise :class:`StaleWeightsError` if the engine does not hold the trainer's current weights."""
        self.version.check(self.engine)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> ShardingManager:
        self.times = PhaseTimes()
        self.offloaded_bytes = 0
        try:
            with self._timed("offload"):
                before = self._read_gpu()
                self.offloaded_bytes += self.actor.offload_before_export()
                return_cached_memory()
                if self.gpu is not None:
                    self.gpu.freed("actor_offload", before, self._read_gpu())
            self._barrier()  # every rank's grads and optimizer state off before an engine maps weights on its GPU
            with self._timed("resume"):
                self.engine.resume_memory(tags=["weights"])
            with self._timed("sync"):
                self.sync_weights()
            with self._timed("offload"):
                before = self._read_gpu()
                self.offloaded_bytes += self.actor.offload_after_export()
                return_cached_memory()
                if self.gpu is not None:  # adds to the first part's
                    self.gpu.freed("actor_offload", before, self._read_gpu())
            self._barrier()  # every rank's parameters off before an engine maps its KV cache on its GPU
            with self._timed("resume"):
                self.engine.resume_memory(tags=["kv_cache"])
            if self.cfg.check_weight_version:
                self.check()
        except BaseException:
            # Leave things as before the rollout: engine released, actor trainable. No barrier here: a rank
            # that failed alone would wait at it while the others wait in a collective of the enter.
            try:
                self.engine.release_memory()
                return_cached_memory()
            finally:
                self.actor.reload()
            raise
        self._training_rng = RngState.capture()
        self._rollout_rng.restore()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._training_rng is not None:
            self._rollout_rng = RngState.capture()  # the next rollout continues this stream
            self._training_rng.restore()
            self._training_rng = None
        with self._timed("release"):
            before = self._read_gpu()
            # Nothing may generate while the engine's memory goes: a rollout that ended (or raised) with requests
            # still out would otherwise meet release's refusal instead of its own error (SGLang: a SIGQUIT).
            # drain is an optional engine member (rollout's engine_drain; sharding may not import rollout)
            drain = getattr(self.engine, "drain", None)
            if drain is not None and not drain(DRAIN_TIMEOUT_S):
                logger.warning("the rollout engine still holds requests %.0f s after aborting them", DRAIN_TIMEOUT_S)
            self.engine.release_memory()
            return_cached_memory()
            if self.gpu is not None:
                self.gpu.freed("engine_release", before, self._read_gpu())
        if exc_info[0] is None:
            # Every engine released before any rank reloads onto a GPU it spans. Not after an error in the
            # rollout: a rank that failed alone would wait here while the others wait in the rollout's
            # collectives (a mismatched collective, a hang until the timeout, instead of a failed run).
            self._barrier()
        with self._timed("reload"):
            self.actor.reload()


__all__ = ["NoEngine", "PhaseTimes", "RolloutPolicy", "ShardingManager", "return_cached_memory"]
