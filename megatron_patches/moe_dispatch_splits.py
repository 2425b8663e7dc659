"""Patch ``moe_dispatch_splits``: the all-to-all dispatcher's split sizes are host integers on CPU too.

Target: ``megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu`` (the name the
dispatcher imported from ``moe_utils``). With ``as_numpy=True`` it returns a numpy array only for a CUDA
tensor; a CPU tensor comes back as a tensor, and ``torch.distributed.all_to_all_single`` refuses a tensor as
``input_split_sizes``/``output_split_sizes`` (its binding wants a sequence of ints): EP > 1 fails on CPU.
The replacement returns ``tensor.numpy()`` for a CPU tensor when ``as_numpy`` and defers to the original
otherwise.

Reason: a CUDA-only branch on the expert-parallel dispatch path. No numerical change.

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when ``maybe_move_tensor_to_cpu`` honours
``as_numpy`` for CPU tensors.
"""

from __future__ import annotations

from typing import Any

from megatron_patches._base import Patch, PatchContext


def _wrap(original: Any) -> Any:
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        import torch

        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _install(ctx: PatchContext) -> None:
    ctx.swap_in("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", _wrap)


PATCH = Patch(
    name="moe_dispatch_splits",
    reason="the all-to-all dispatcher passes CPU split-size tensors where all_to_all_single wants ints",
    install=_install,
)
