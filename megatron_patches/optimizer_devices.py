"""Patch ``optimizer_devices``: Megatron optimizers, grad clipping and the distributed optimizer on CPU.

Targets (module-global ``torch`` rebound to the CPU view, see ``_cpu_torch``):
``megatron.core.optimizer.optimizer`` (``MixedPrecisionOptimizer``/``FP32Optimizer``
keep ``found_inf``/``_scale`` in ``device='cuda'`` tensors),
``megatron.core.optimizer.clip_grads`` (``get_grad_norm_fp32``,
``clip_grad_by_total_norm_fp32``, ``count_zeros_fp32`` allocate on ``'cuda'``),
``megatron.core.optimizer.distrib_optimizer`` (state gather buffers on
``torch.cuda.current_device()``), ``megatron.core.optimizer.grad_scaler``,
``megatron.core.optimizer`` (package ``__init__``).

Plus ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (also the
name imported into ``megatron.core.optimizer.optimizer``): it asserts
``param.grad.type() == 'torch.cuda.FloatTensor'``. The CPU replacement keeps the
contract (fp32 grads, scale in place by ``max_norm / (total_norm + 1e-6)`` when
that is < 1) and scales with ``torch._foreach_mul_``, which computes the same
product as ``multi_tensor_scale``.

Plus ``DistributedOptimizer.__init__`` and ``Float16OptimizerWithFloat16Params.__init__``:
they sort parameters by ``param.type()`` against the literal names
``'torch.cuda.FloatTensor'`` / ``'torch.cuda.HalfTensor'`` / ``'torch.cuda.BFloat16Tensor'``
and raise ``TypeError`` for CPU tensors. While (only while) those constructors
run, ``Tensor.type()`` with no argument reports a CPU tensor under its CUDA name
(``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``), so the dtype-based
grouping is unchanged. Constructors are single-threaded setup code.

Plus ``DistributedOptimizer.get_parameter_state_dp_zero`` (checkpointing the optimizer
state without gloo gathers calls ``send_tensor.cuda()``): runs with ``Tensor.cuda`` as
the identity.

Reason: CUDA hard-coded; on CPU these are CPU tensors reduced over gloo. The
norm falls back to ``torch.norm`` per tensor when apex/TE's multi-tensor L2
norm is unavailable (megatron's own fallback). No numerical change.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when the optimizer takes a device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch, tensor_methods, within, wrap_cuda_calls

MODULES = (
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
)


def clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Device-agnostic ``clip_grad_by_total_norm_fp32``: scale fp32 grads in place by the clip coefficient."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        if grad.dtype not in allowed:
            raise TypeError(f"clip_grad_by_total_norm_fp32 expects fp32 grads, got {grad.dtype}")
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def cuda_type_names() -> contextlib.AbstractContextManager:
    """Within the block, ``cpu_tensor.type()`` returns the CUDA tensor-type name of the same dtype."""
    real_type = torch._C.TensorBase.type

    def type_as_cuda(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return real_type(self).replace("torch.", "torch.cuda.", 1)
        return real_type(self, dtype, non_blocking, **kwargs)

    return tensor_methods({"type": type_as_cuda})


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, MODULES)
    for dotted in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        ctx.swap_in(dotted, "clip_grad_by_total_norm_fp32", lambda _orig: clip_grad_by_total_norm_fp32)
    for dotted, cls_name in (
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
        ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
    ):
        mod = ctx.module(dotted)
        cls = getattr(mod, cls_name, None) if mod is not None else None
        if cls is not None:
            ctx.swap(cls, "__init__", within(cuda_type_names)(cls.__init__))
    wrap_cuda_calls(
        ctx, (("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "get_parameter_state_dp_zero"),)
    )


PATCH = Patch(
    name="optimizer_devices",
    reason="optimizer scalars, grad-norm and distributed-optimizer buffers are allocated on CUDA",
    install=_install,
)
