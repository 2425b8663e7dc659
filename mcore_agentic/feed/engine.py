"""A rollout group's engine, on its leader: built before any worker holds device memory, then released."""

from __future__ import annotations

from typing import Any

from mcore_agentic.parallel import comm
from mcore_agentic.rollout.config import RolloutConfig


def build_rollout_engine(cfg: RolloutConfig, placement: Any, model: Any, *, seed: int) -> Any:
    """This rank's rollout engine (None off a rollout group's leader), built and then released.

    ``model``: the model spec (``model_path``, ``dtype``, ``routing_shape``). Built before any worker holds device
    memory: vLLM refuses to start unless ``rollout.gpu_memory_utilization`` x the GPU's memory is free, and SGLang
    sizes its weights + KV cache from the memory free when it starts. Released at once (the first rollout resumes it
    and syncs the actor's weights into it), so the workers are built on the memory it gave back. Its construction
    leaves the global RNG states as they were.
    """
    from mcore_agentic.rollout.engines import build_engine
    from mcore_agentic.utils.seeding import RngState

    if not placement.is_leader:
        return None  # a rollout group's other ranks hold none (see parallel.rollout_placement)
    device = comm.compute_device()
    rng = RngState.capture()
    try:
        engine = build_engine(cfg, model, device=str(device), seed=seed)
    finally:
        rng.restore()
    engine.release_memory()
    return engine
