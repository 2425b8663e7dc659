"""Patch ``hybrid_optimizer_state_dict``: the CPU-offloaded optimizer's state dict holds values, not classes.

Target: ``megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer.state_dict``. The hybrid
optimizer passes its sub-optimizer classes (``cpu_optimizer_cls``, ``gpu_optimizer_cls``: torch's ``AdamW``,
TransformerEngine's or apex's ``FusedAdam``) to ``torch.optim.Optimizer`` as defaults, so every parameter group, and
with it the distributed optimizer's common checkpoint state, carries the classes themselves. A checkpoint then only
loads by unpickling arbitrary globals: megatron-core reads the common state with ``torch.load``'s default
``weights_only=True``, which refuses (``Unsupported global: torch.optim.adamw.AdamW``), so a run with
``optimizer_cpu_offload`` could save but never resume. The patch leaves class-valued entries out of the saved groups.
They are construction arguments, not state: the optimizer reads them from ``self.defaults`` and its own attributes,
never from a group, and a loaded group keeps every saved value it had (lr, betas, eps, step).

Reason: constructor arguments stored as optimizer state. No numerical change. Applied on GPU too (not ``cpu_only``).

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when the hybrid optimizer keeps its classes out of
its param groups.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_patches._base import Patch, PatchContext

MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"


def _without_classes(state_dict: Any) -> Any:
    @functools.wraps(state_dict)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = state_dict(self, *args, **kwargs)
        out["param_groups"] = [{k: v for k, v in group.items() if not isinstance(v, type)}
                               for group in out["param_groups"]]
        return out

    return wrapped


def _install(ctx: PatchContext) -> None:
    cls = ctx.attr(MODULE, "HybridDeviceOptimizer")
    if cls is not None:
        ctx.wrap(cls, "state_dict", _without_classes)


PATCH = Patch(
    name="hybrid_optimizer_state_dict",
    reason="the CPU-offloaded optimizer saves its sub-optimizer classes, so its checkpoints cannot load weights-only",
    install=_install,
    cpu_only=False,
)
