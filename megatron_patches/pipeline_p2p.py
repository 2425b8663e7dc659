"""Patch ``pipeline_p2p``: pipeline schedules and p2p send/recv use CPU tensors (gloo).

Targets (module-global ``torch`` rebound to the CPU view, see ``_cpu_torch``):
``megatron.core.pipeline_parallel.p2p_communication`` (``_communicate`` /
``_communicate_shapes`` allocate receive buffers on ``torch.cuda.current_device()``
and call ``torch.cuda.synchronize()``), ``megatron.core.pipeline_parallel.schedules``
(``forward_backward_*`` count tokens in ``torch.zeros([], device="cuda")``),
``megatron.core.pipeline_parallel.utils``.

Reason: PP=2 on gloo needs CPU receive buffers; gloo supports the batched
isend/irecv Megatron issues. No numerical change.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when the schedules take a device.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch

MODULES = (
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
)


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, MODULES)


PATCH = Patch(
    name="pipeline_p2p",
    reason="pipeline schedules / p2p allocate receive buffers and counters on CUDA",
    install=_install,
)
