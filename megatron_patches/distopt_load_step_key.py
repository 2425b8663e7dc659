"""Patch ``distopt_load_step_key``: the fully-reshardable optimizer load with torch's Adam (``KeyError: 'step'``).

Target: ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer
.load_parameter_state_from_fully_reshardable``.

Reason: the method copies the checkpoint's per-parameter tensors into the optimizer through
``_set_main_param_and_optimizer_states``, which copies *every* key of the inner optimizer's
per-parameter state from the source. Without Apex/TransformerEngine the inner optimizer is
``torch.optim.Adam``, whose per-parameter state includes ``step``; the fully-reshardable
format keeps ``step`` in the param groups instead (the method itself skips a ``step`` source
key), so the copy raises ``KeyError: 'step'`` and a ``fully_reshardable`` checkpoint cannot be
loaded. The wrapper sets the per-parameter ``step`` tensors aside for the call and puts them
back afterwards (``load_state_dict`` has already set them from the param groups). Identical to
the original when no per-parameter ``step`` exists (TE/Apex).

Upstream: megatron-core 0.16.1 ``DistributedOptimizer._set_main_param_and_optimizer_states``
(non-precision-aware branch: ``dst_tensors[key].copy_(tensors[key])`` for every key). No upstream
issue known to us.

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when that copy skips ``step``.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_patches._base import Patch, PatchContext

_MODULE = "megatron.core.optimizer.distrib_optimizer"


def _without_per_param_step(load: Any) -> Any:
    @functools.wraps(load)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        per_param = self.optimizer.state
        steps = {p: s.pop("step") for p, s in per_param.items() if "step" in s}
        try:
            return load(self, *args, **kwargs)
        finally:
            for p, step in steps.items():
                per_param[p]["step"] = step

    return wrapped


def _install(ctx: PatchContext) -> None:
    ctx.wrap(
        ctx.attr(_MODULE, "DistributedOptimizer"), "load_parameter_state_from_fully_reshardable", _without_per_param_step
    )


PATCH = Patch(
    name="distopt_load_step_key",
    reason="DistributedOptimizer's fully-reshardable load copies torch Adam's per-parameter 'step' from a source without it",
    install=_install,
    cpu_only=False,
)
