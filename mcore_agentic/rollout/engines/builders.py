"""Each engine's builder, which the engine table names (:mod:`~mcore_agentic.rollout.engines.registry`): the one
place engines are built, and the one place an engine reads the model spec.

Every builder takes ``(cfg, model, *, device, seed)`` as :func:`~mcore_agentic.rollout.engines.build_engine` does
and imports its adapter (and so its package) only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcore_agentic.rollout.engines import SGLANG_BASE_PORT, EngineModel

if TYPE_CHECKING:
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines.base import RolloutEngine


def build_hf(cfg: RolloutConfig, model: EngineModel, *, device: str, seed: int | None) -> RolloutEngine:
    """:class:`~mcore_agentic.rollout.engines.hf.HFEngine` on ``device`` (rollout TP only sets how many ranks share
    it: the model is not sharded), reusing finished requests' KV caches unless ``rollout.enable_prefix_caching`` is
    off."""
    import torch

    from mcore_agentic.rollout.engines.hf import HFEngine

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[model.dtype]
    reuse = cfg.enable_prefix_caching
    return HFEngine.from_pretrained(
        str(model.model_path), dtype=torch_dtype, device=str(torch.device(device)), seed=seed or 0,
        record_routing=model.routing_shape is not None,
        prefix_cache_entries=cfg.prefix_cache_entries if reuse else 0,
        prefix_cache_bytes=cfg.prefix_cache_memory_mb * 2**20 if reuse else 0,
    )


def build_vllm(cfg: RolloutConfig, model: EngineModel, *, device: str, seed: int | None) -> RolloutEngine:
    """:class:`~mcore_agentic.rollout.engines.vllm.VLLMEngine` in this process (TP=1)."""
    import torch

    if model.routing_shape is not None:
        from mcore_agentic.utils.errors import ConfigError

        raise ConfigError("actor.moe.routing_replay", "rollout.name=vllm does not return routed experts (vLLM 0.32 "
                          "does only with its V2 model runner, which needs Triton on a GPU): use rollout.name=hf "
                          "(CPU) or sglang, or set actor.moe.routing_replay=disable")
    from mcore_agentic.rollout.engines.vllm import VLLMEngine
    from mcore_agentic.rollout.engines.vllm_args import default_kv_cache_bytes

    dev = torch.device(device)
    model_path, dtype = str(model.model_path), model.dtype
    kv_bytes = cfg.kv_cache_memory_mb * 2**20 if cfg.kv_cache_memory_mb is not None else None
    if kv_bytes is None and dev.type == "cpu":  # vLLM would otherwise reserve half the machine's memory
        kv_bytes = default_kv_cache_bytes(model_path, max_model_len=cfg.effective_max_model_len, dtype=dtype)
    return VLLMEngine(
        model_path,
        device=str(dev),
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        seed=seed,
        dtype=dtype,
        max_model_len=cfg.effective_max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=cfg.enable_prefix_caching,
        engine_kwargs={"block_size": cfg.vllm_block_size} if cfg.vllm_block_size else None,
    )


def build_sglang(cfg: RolloutConfig, model: EngineModel, *, device: str, seed: int | None) -> RolloutEngine:
    """An in-process :class:`~mcore_agentic.rollout.engines.sglang.SGLangEngine` with TP =
    ``rollout.tensor_model_parallel_size`` over the group's GPUs, starting at ``device``'s, and one port per engine
    of the node."""
    import torch

    from mcore_agentic.rollout.engines.sglang import SGLangEngine

    dev = torch.device(device)
    local_rank = dev.index if dev.index is not None else 0
    return SGLangEngine(
        str(model.model_path),
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        seed=seed,
        dtype=model.dtype,
        # rollout.seed promises reproducible samples: SGLang honours seeds only with deterministic inference
        deterministic=cfg.seed is not None,
        base_gpu_id=local_rank,
        port=SGLANG_BASE_PORT + 100 * (local_rank // cfg.tensor_model_parallel_size),
        routing_shape=model.routing_shape,
    )
