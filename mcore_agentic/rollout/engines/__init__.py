"""Generation engines behind one async interface: transformers (the reference), vLLM (CPU and GPU) and SGLang (GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines.base import RolloutEngine

SGLANG_BASE_PORT = 30000
"""Engine ``i`` of a node: ``port=SGLANG_BASE_PORT + 100 * i`` (unbound on one node: IPC + a free NCCL port)."""


class EngineModel(Protocol):
    """What an engine reads of the run's model spec (``mcore_agentic.models.spec.ModelSpec``, which the trainer
    builds once; rollout does not import ``models``, so the spec arrives typed by this protocol)."""

    @property
    def model_path(self) -> str:
        """The local HF checkpoint directory."""

    @property
    def dtype(self) -> str:
        """``model.dtype``'s names: ``float32``, ``bfloat16``, ``float16``."""

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """``(moe_layers, top_k)`` of a mixture-of-experts model whose routers' choices each request returns
        (``actor.moe.routing_replay``; hf and sglang); None: none."""


def build_engine(cfg: RolloutConfig, model: EngineModel, *, device: str, seed: int | None) -> RolloutEngine:
    """The engine ``rollout.name`` names, loaded from the model spec's local HF checkpoint (the one place engines
    are built, and the one place an engine reads the spec).

    ``device``: this rank's device (``"cpu"``, ``"cuda:3"``); ``seed``: the engine's sampling seed (the trainer
    passes the run's ``seed``). From ``model``: the checkpoint, the dtype, and the routing shape of a
    mixture-of-experts model whose routed experts each request returns.

    ``hf``: :class:`~mcore_agentic.rollout.engines.hf.HFEngine` on ``device`` (rollout TP only sets how
    many ranks share it: the model is not sharded), reusing finished requests' KV caches unless
    ``rollout.enable_prefix_caching`` is off. ``vllm``:
    :class:`~mcore_agentic.rollout.engines.vllm.VLLMEngine` in this process (TP=1). ``sglang``: an
    in-process :class:`~mcore_agentic.rollout.engines.sglang.SGLangEngine` with TP =
    ``rollout.tensor_model_parallel_size`` over the group's GPUs, starting at ``device``'s, and one
    port per engine of the node.
    """
    import torch

    dev = torch.device(device)
    model_path, dtype, routing_shape = str(model.model_path), model.dtype, model.routing_shape
    if cfg.name == "hf":
        from mcore_agentic.rollout.engines.hf import HFEngine

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        reuse = cfg.enable_prefix_caching
        return HFEngine.from_pretrained(
            model_path, dtype=torch_dtype, device=str(dev), seed=seed or 0, record_routing=routing_shape is not None,
            prefix_cache_entries=cfg.prefix_cache_entries if reuse else 0,
            prefix_cache_bytes=cfg.prefix_cache_memory_mb * 2**20 if reuse else 0,
        )
    if cfg.name == "vllm":
        if routing_shape is not None:
            from mcore_agentic.utils.errors import ConfigError

            raise ConfigError("actor.moe.routing_replay", "rollout.name=vllm does not return routed experts (vLLM 0.32 "
                              "does only with its V2 model runner, which needs Triton on a GPU): use rollout.name=hf "
                              "(CPU) or sglang, or set actor.moe.routing_replay=disable")
        from mcore_agentic.rollout.engines.vllm import VLLMEngine, default_kv_cache_bytes

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
    from mcore_agentic.rollout.engines.sglang import SGLangEngine

    local_rank = dev.index if dev.index is not None else 0
    return SGLangEngine(
        model_path,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        seed=seed,
        dtype=dtype,
        # rollout.seed promises reproducible samples: SGLang honours seeds only with deterministic inference
        deterministic=cfg.seed is not None,
        base_gpu_id=local_rank,
        port=SGLANG_BASE_PORT + 100 * (local_rank // cfg.tensor_model_parallel_size),
        routing_shape=routing_shape,
    )
