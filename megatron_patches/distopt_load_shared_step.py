"""Patch ``distopt_load_shared_step``: after a load, each parameter of torch's Adam has its own ``step`` tensor.

Target: ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict``.

Reason: without Apex/TransformerEngine (torch's Adam, ``step`` per parameter) the method
builds *one* ``step`` tensor from the param groups and assigns that same object to every
parameter's state; ``torch.optim.Optimizer.load_state_dict`` keeps it shared (it does not
copy ``step``). torch's Adam increments ``step`` in place for each parameter, so after a
resume one optimizer step advances the shared counter once per parameter: from the first
resumed step on, parameters get the bias correction of a later step, and the next save holds
a wrong ``step``. Silent: no error, a different training run. The wrapper gives every
parameter its own copy after the original method (including its parameter-state load) has
run. No change when no per-parameter ``step`` tensor exists (TE/Apex).

Upstream: megatron-core 0.16.1 ``DistributedOptimizer.load_state_dict`` (``s["step"] = step``
in its ``not HAVE_APEX_OR_TE`` branch; the ``HybridDeviceOptimizer`` branch next to it already
clones). No upstream issue known to us.

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when that branch clones
``step`` per parameter.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_patches._base import Patch, PatchContext

_MODULE = "megatron.core.optimizer.distrib_optimizer"


def _own_step_per_param(load_state_dict: Any) -> Any:
    @functools.wraps(load_state_dict)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_state_dict(self, *args, **kwargs)
        inner = getattr(self, "optimizer", None)
        for state in inner.state.values() if inner is not None else ():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()
        return result

    return wrapped


def _install(ctx: PatchContext) -> None:
    ctx.wrap(ctx.attr(_MODULE, "DistributedOptimizer"), "load_state_dict", _own_step_per_param)


PATCH = Patch(
    name="distopt_load_shared_step",
    reason="DistributedOptimizer.load_state_dict gives every parameter the same torch Adam 'step' tensor",
    install=_install,
    cpu_only=False,
)
