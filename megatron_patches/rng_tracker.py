"""Patch ``rng_tracker``: Megatron's CUDA RNG tracker forks the CPU generator on CPU.

Target: ``megatron.core.tensor_parallel.random._get_cuda_rng_state``,
``._set_cuda_rng_state`` and the module's ``torch.cuda.{get_rng_state,manual_seed}``
calls (used by ``CudaRNGStatesTracker.add/fork`` and
``model_parallel_cuda_manual_seed``).

Reason: the tracker keeps one RNG state per parallel region (data-parallel,
tensor-parallel, expert) and swaps it into the *CUDA* default generator inside
``fork()``; weight init (``_initialize_affine_weight_gpu``) and dropout run under
it. Without CUDA, ``torch.cuda.get_rng_state`` raises, and ``_set_cuda_rng_state``
silently queues its work behind ``torch.cuda._lazy_call`` so a fork would never
take effect. On CPU the generator that ops actually draw from is the CPU default
generator, so the tracker swaps that one. Same seeding rules
(``seed + 2718 + tp_rank`` for the TP region) as on GPU, so per-rank streams
differ exactly where Megatron intends them to.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped) (same private helpers). Remove when
megatron-core's tracker is device-agnostic (none announced).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch

_MODULE = "megatron.core.tensor_parallel.random"


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU version of ``_get_cuda_rng_state``: a copy of the CPU default generator's state."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU version of ``_set_cuda_rng_state``: applied immediately (no lazy CUDA callback)."""
    torch.set_rng_state(new_state)


def _drop_cpu_state_changed(record: logging.LogRecord) -> bool:
    # fork() warns when the CPU generator changed inside the fork; on CPU that generator *is* the
    # forked one, so the change is the point, not a bug. Drop exactly that message.
    return "CPU RNG state changed within GPU RNG context" not in str(record.msg)


def _install(ctx: PatchContext) -> None:
    mod = ctx.module(_MODULE)
    if mod is None:
        return
    ctx.swap(mod, "_get_cuda_rng_state", _get_cpu_rng_state)
    ctx.swap(mod, "_set_cuda_rng_state", _set_cpu_rng_state)
    rebind_torch(ctx, (_MODULE,))
    log = logging.getLogger(_MODULE)
    ctx.swap(log, "filters", [*log.filters, _drop_cpu_state_changed])


PATCH = Patch(
    name="rng_tracker",
    reason="CudaRNGStatesTracker / model_parallel_cuda_manual_seed fork the CPU generator when there is no CUDA",
    install=_install,
)
