"""Patch ``moe_devices``: the mixture-of-experts layer, router and token dispatcher run on CPU.

Targets (module-global ``torch`` rebound to the CPU view, see ``_cpu_torch``):
``megatron.core.transformer.moe.{router,experts,token_dispatcher,moe_utils,moe_layer,shared_experts}``, e.g.
``Router.gating`` (moves the router weight to ``torch.cuda.current_device()`` on every forward),
``MoEAlltoAllTokenDispatcher.__init__`` (``torch.cuda.Stream()`` for the device-to-host copies of the
split sizes) and its ``torch.cuda.current_stream``/``record_event`` calls (inert streams on CPU).

Reason: CUDA hard-coded on the MoE forward path. No numerical change.

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when megatron-core's MoE allocates on the
input's device.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch

MODULES = tuple(
    f"megatron.core.transformer.moe.{name}"
    for name in ("router", "experts", "token_dispatcher", "moe_utils", "moe_layer", "shared_experts")
)


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, MODULES)


PATCH = Patch(
    name="moe_devices",
    reason="MoE router/dispatcher allocate on torch.cuda.current_device() and open CUDA streams",
    install=_install,
)
