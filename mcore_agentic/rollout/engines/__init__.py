"""Generation engines behind one async interface: transformers (the reference), vLLM (CPU and GPU) and SGLang (GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines.base import RolloutEngine


def build_engine(cfg: RolloutConfig, model_path: str | Path, *, device: str = "cpu", **kwargs: Any) -> RolloutEngine:
    """The engine ``rollout.name`` names, loaded from a local HF checkpoint directory.

    ``hf``: :class:`~mcore_agentic.rollout.engines.hf.HFEngine` on ``device``; ``vllm``:
    :class:`~mcore_agentic.rollout.engines.vllm.VLLMEngine` (in-process, TP=1); ``sglang``:
    :class:`~mcore_agentic.rollout.engines.sglang.SGLangEngine` with ``rollout.tensor_model_parallel_size``
    and ``rollout.gpu_memory_utilization``. ``dtype`` (``model.dtype``'s names) and ``seed`` default to
    float32 and ``rollout.seed``; other ``kwargs`` go to the engine's constructor.
    """
    if cfg.name == "hf":
        import torch

        from mcore_agentic.rollout.engines.hf import HFEngine

        dtype = kwargs.pop("dtype", "float32")
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        seed = kwargs.pop("seed", cfg.seed)
        return HFEngine.from_pretrained(model_path, dtype=torch_dtype, device=device, seed=seed or 0, **kwargs)
    if cfg.name == "vllm":
        from mcore_agentic.rollout.engines.vllm import VLLMEngine, default_kv_cache_bytes

        dtype = kwargs.pop("dtype", "float32")
        kv_bytes = cfg.kv_cache_memory_mb * 2**20 if cfg.kv_cache_memory_mb is not None else None
        if kv_bytes is None and device == "cpu":  # vLLM would otherwise reserve half the machine's memory
            kv_bytes = default_kv_cache_bytes(model_path, max_model_len=cfg.effective_max_model_len, dtype=dtype)
        return VLLMEngine(
            model_path,
            device=device,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            seed=kwargs.pop("seed", cfg.seed),
            dtype=dtype,
            max_model_len=cfg.effective_max_model_len,
            kv_cache_memory_bytes=kv_bytes,
            enable_prefix_caching=cfg.enable_prefix_caching,
            **kwargs,
        )
    from mcore_agentic.rollout.engines.sglang import SGLangEngine

    seed = kwargs.pop("seed", cfg.seed)
    return SGLangEngine(
        str(model_path),
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        seed=seed,
        # rollout.seed promises reproducible samples: SGLang honours seeds only with deterministic inference
        deterministic=kwargs.pop("deterministic", cfg.seed is not None),
        **kwargs,
    )
