"""Patch ``distopt_load_unstepped``: a never-stepped ``DistributedOptimizer`` with torch's Adam can be loaded into.

Target: ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict``.

Reason: without Apex/TransformerEngine (``distrib_optimizer.HAVE_APEX_OR_TE`` False: on CPU,
or a GPU install without them) the inner optimizer is ``torch.optim.Adam``, which keeps
``step`` per parameter and creates its state at the first ``step()``. A checkpoint load
starts with ``sharded_state_dict(is_loading=True)``, whose first call is ``self.state_dict()``;
that collects the per-parameter ``step`` values and asserts there is exactly one, so on an
optimizer that has not stepped yet (a fresh process resuming) it raises ``AssertionError``.
The wrapper gives such an optimizer, before a *loading* ``sharded_state_dict``, the state
torch's Adam would create at its first step (``step`` 0, zero moments); the load then
overwrites it. No change with TE/Apex (``step`` lives in the param groups), for an optimizer
that has stepped, or for a save.

Upstream: megatron-core 0.16.1 ``DistributedOptimizer.state_dict`` (its ``not HAVE_APEX_OR_TE``
branch); ``DistributedOptimizer.load_state_dict`` itself handles unallocated state. No upstream
issue known to us.

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when ``state_dict()`` accepts
a never-stepped torch Adam.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from megatron_patches._base import Patch, PatchContext

_MODULE = "megatron.core.optimizer.distrib_optimizer"


def prime_unstepped_adam_state(optimizer: Any) -> bool:
    """Give ``optimizer``'s inner torch Adam the state of its first step if it has none; True if it did.

    The CPU-offloaded optimizer (``HybridDeviceOptimizer``) keeps torch Adams of its own: each is primed, then their
    state is gathered into the hybrid optimizer's as its own steps do (megatron-core's alternative, ``dummy_step``,
    steps the model's parameters with random gradients)."""
    from megatron.core.optimizer import distrib_optimizer

    inner = getattr(optimizer, "optimizer", None)
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return False
    if isinstance(inner, distrib_optimizer.HybridDeviceOptimizer):
        primed = [_prime(sub) for sub in inner.sub_optimizers if isinstance(sub, torch.optim.Adam | torch.optim.AdamW)]
        if any(primed):
            inner._sync_sub_optimizers_state_to_hdo()
        return any(primed)
    return isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and _prime(inner)


def _prime(inner: torch.optim.Optimizer) -> bool:
    # ``state`` is a defaultdict: a lookup leaves an empty entry behind, so "never stepped" is "no entry has a key".
    if any(len(s) for s in inner.state.values()):
        return False
    for group in inner.param_groups:
        on_device = group.get("capturable", False) or group.get("fused", False)
        for p in group["params"]:
            state = inner.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True


def _priming_before_load(sharded_state_dict: Any) -> Any:
    signature = inspect.signature(sharded_state_dict)

    @functools.wraps(sharded_state_dict)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if signature.bind(self, *args, **kwargs).arguments.get("is_loading", False):
            prime_unstepped_adam_state(self)
        return sharded_state_dict(self, *args, **kwargs)

    return wrapped


def _install(ctx: PatchContext) -> None:
    ctx.attr(_MODULE, "HAVE_APEX_OR_TE")  # read at call time; recorded if this version lacks it
    ctx.wrap(ctx.attr(_MODULE, "DistributedOptimizer"), "sharded_state_dict", _priming_before_load)


PATCH = Patch(
    name="distopt_load_unstepped",
    reason="DistributedOptimizer.state_dict() asserts on a never-stepped torch Adam, so a fresh one cannot be loaded into",
    install=_install,
    cpu_only=False,
)
