"""Patch ``tensor_parallel_devices``: TP layers and collectives allocate on CPU.

Targets (module-global ``torch`` rebound to the CPU view, see ``_cpu_torch``):
``megatron.core.tensor_parallel.{layers,mappings,utils,data}`` — e.g.
``mappings._gather_along_first_dim`` and ``layers.LinearWithGradAccumulationAndAsyncCommunication``
allocate their output with ``device=torch.cuda.current_device()``, ``data.broadcast_data``
uses ``device='cuda'``; weight init under ``_initialize_affine_weight_gpu`` puts
parameters on ``torch.cuda.current_device()``. Plus
``megatron.core.tensor_parallel.data.broadcast_data`` whose ``tensor.cuda()`` call
becomes a no-op on CPU.

Reason: these hard-code CUDA; on CPU every such buffer must be a CPU tensor so
gloo collectives can run on it. No numerical change: the same ops on CPU.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when megatron-core takes a device
argument on these paths (none announced).
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch

MODULES = (
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
)


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, MODULES)


PATCH = Patch(
    name="tensor_parallel_devices",
    reason="TP layers/collectives allocate with torch.cuda.current_device() or device='cuda'",
    install=_install,
)
