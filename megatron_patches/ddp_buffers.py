"""Patch ``ddp_buffers``: Megatron DDP's contiguous param/grad buffers live on CPU.

Targets (module-global ``torch`` rebound to the CPU view, see ``_cpu_torch``):
``megatron.core.distributed.param_and_grad_buffer`` (``_ParamAndGradBuffer.__init__``
allocates ``param_data``/``grad_data`` on ``torch.cuda.current_device()``;
``_ParamAndGradBucketGroup`` uses CUDA streams for overlapped communication),
``megatron.core.distributed.distributed_data_parallel`` (``torch.cuda.Stream``,
``torch.cuda.synchronize``).

Reason: DDP + the distributed optimizer reduce-scatter/all-gather these buffers;
on gloo they must be CPU tensors. Streams are inert on CPU (work is already
ordered). No numerical change.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when DDP takes a device.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch

MODULES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
)


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, MODULES)


PATCH = Patch(
    name="ddp_buffers",
    reason="DDP param/grad buffers and comm streams are allocated on CUDA",
    install=_install,
)
