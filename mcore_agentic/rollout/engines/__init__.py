"""Generation engines behind one async interface: transformers (CPU) and SGLang (GPU, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines.base import RolloutEngine


def build_engine(cfg: RolloutConfig, model_path: str | Path, *, device: str = "cpu", **kwargs: Any) -> RolloutEngine:
    """The engine ``rollout.name`` names, loaded from a local HF checkpoint directory.

    ``hf``: :class:`~mcore_agentic.rollout.engines.hf.HFEngine` on ``device``; ``sglang``:
    :class:`~mcore_agentic.rollout.engines.sglang.SGLangEngine` with ``rollout.tensor_model_parallel_size``
    and ``rollout.gpu_memory_utilization``. ``kwargs`` go to the engine's constructor.
    """
    if cfg.name == "hf":
        from mcore_agentic.rollout.engines.hf import HFEngine

        return HFEngine.from_pretrained(model_path, device=device, seed=cfg.seed or 0, **kwargs)
    from mcore_agentic.rollout.engines.sglang import SGLangEngine

    return SGLangEngine(
        str(model_path),
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        seed=cfg.seed,
        **kwargs,
    )
