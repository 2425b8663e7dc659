"""vLLM's weight-update path for buckets handed over in this process, and what a complete sync must send.

``mcore_inproc`` is a weight-transfer backend registered with vLLM's factory: vLLM's worker
calls it between ``start_weight_update`` and ``finish_weight_update``; it loads each bucket
(Hugging Face-named tensors, passed by reference, never serialised) through the model's own
``load_weights`` inside vLLM's layerwise reload, which re-runs the kernels' weight processing
(the CPU build repacks linear weights). Tied checkpoints get the head fed the embedding: the
reload unties them. Mixture-of-experts layers get their experts kernel's own weight processing run
again after the reload (:func:`reprocess_experts`): vLLM runs it at the first load only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

INPROC_BACKEND = "mcore_inproc"


def register_inproc_backend() -> None:
    """Register ``mcore_inproc`` with vLLM's weight-transfer factory (idempotent): buckets by reference."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if INPROC_BACKEND in WeightTransferEngineFactory._registry:
        return

    @dataclass
    class InprocInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class InprocUpdateInfo(WeightTransferUpdateInfo):
        named_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    class InprocWeightTransfer(WeightTransferEngine):
        """Loads buckets handed over in this process into the model under vLLM's layerwise reload."""

        init_info_cls = InprocInitInfo
        update_info_cls = InprocUpdateInfo

        def init_transfer_engine(self, init_info: Any) -> None:
            del init_info

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: Any) -> None:
            tensors = update_info.named_tensors
            self.model.load_weights(iter(tensors))
            # A tied checkpoint has no lm_head tensor, and the layerwise reload unties the head (it would keep
            # its old kernel weights): feed it the embedding, as if it had its own tensor.
            if getattr(self.model_config.hf_config, "tie_word_embeddings", False):
                head = getattr(self.model, "lm_head", None)
                for name, tensor in tensors:
                    if name.endswith("embed_tokens.weight") and head is not None:
                        head.weight.weight_loader(head.weight, tensor)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            reprocess_experts(self.model)

        def shutdown(self) -> None:
            pass

    WeightTransferEngineFactory.register_engine(INPROC_BACKEND, InprocWeightTransfer)


def reprocess_experts(model: torch.nn.Module) -> int:
    """Run each unquantized MoE layer's experts-kernel weight processing again; returns how many layers.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` calls ``moe_kernel.fused_experts.
    process_weights_after_loading`` only when it builds the kernel (the first load): on a weight update the
    reloaded experts stay in checkpoint layout, which the CPU kernel reads as its prepacked grouped-GEMM
    layout (wrong outputs, no error). Every MoE layer is reloaded in a complete sync, so each gets its
    processing once more, exactly as at the first load.
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)
            count += 1
    return count


class QuietReload(logging.Filter):
    """Drops vLLM's per-sync 'RotaryEmbedding: Failed to load weights' (a rotary cache has no checkpoint tensor)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage() or "Rotary" not in record.getMessage()


def finish_reload(worker: Any) -> None:
    """Runs on vLLM's worker: end a layerwise reload that a failed bucket left open."""
    worker.weight_transfer_engine.finish_weight_update()


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the checkpoint's safetensors files (what a complete sync must send)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors files in {path}: the vLLM engine needs a safetensors checkpoint")
    return shapes


__all__ = ["INPROC_BACKEND", "QuietReload", "checkpoint_shapes", "finish_reload", "register_inproc_backend",
           "reprocess_experts"]
