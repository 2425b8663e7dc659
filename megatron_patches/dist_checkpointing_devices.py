"""Patch ``dist_checkpointing_devices``: ``dist_checkpointing`` save/load on CPU.

Targets (module-global ``torch`` rebound to the CPU view, see ``_cpu_torch``):
``megatron.core.dist_checkpointing.exchange_utils`` (exchanges loaded shards in
``torch.empty_like(..., device="cuda")`` buffers), ``...strategies.state_dict_saver``
(``verify_global_md_reuse`` / failure flags in ``device='cuda'`` tensors),
``...tensor_aware_state_dict`` (``torch.cuda.synchronize``),
``...strategies.filesystem_async.FileSystemWriterAsync.preload_tensors`` (every
torch_dist save: ``torch.cuda.synchronize()`` after the D2H copies),
``...strategies.async_utils`` (liveness flags on ``torch.cuda.current_device()``).

Plus ``exchange_utils.exchange_loaded_tensors_gather_rounds`` / ``..._broadcast``
(fully-parallel load exchanges call ``tensor.cuda()``): run with ``Tensor.cuda`` as the
identity.

Reason: CUDA hard-coded; on gloo these exchanges use CPU tensors.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when these take the tensors' device.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch, wrap_cuda_calls

MODULES = (
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, MODULES)
    exchange = "megatron.core.dist_checkpointing.exchange_utils"
    wrap_cuda_calls(
        ctx,
        ((exchange, None, "exchange_loaded_tensors_gather_rounds"), (exchange, None, "exchange_loaded_tensors_broadcast")),
    )


PATCH = Patch(
    name="dist_checkpointing_devices",
    reason="dist_checkpointing exchange/verify buffers are allocated on CUDA",
    install=_install,
)
