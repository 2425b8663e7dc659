"""The trained model's DDP wrapper, Megatron optimizer and LR scheduler, as :class:`~.megatron_model.MegatronModel`
builds them when it is given an ``optim`` (a frozen model has none of them).

* :func:`wrap_ddp`: each chunk in Megatron's ``DistributedDataParallel`` (``Float16Module`` first for bf16/fp16);
  gradients reduced in fp32, summed (the loss is normalised globally, see :mod:`.megatron_model`);
* :func:`build_optimizer`: megatron-core's Adam (the distributed optimizer by default; ``optim.optimizer_cpu_offload``:
  its hybrid optimizer, :func:`host_optimizer_kwargs`) and its ``OptimizerParamScheduler`` over
  :func:`decay_horizon` steps; fp16's dynamic loss scale through the transformer config's ``grad_scale_func``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mcore_agentic.workers.config import OptimConfig


def host_optimizer_kwargs(optim: OptimConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """megatron-core's ``OptimizerConfig`` fields for ``optim.optimizer_cpu_offload`` (none without it).

    The hybrid optimizer reuses the precision-aware path (its host copies are the fp32 masters, the device keeps
    only the model's own params), as Megatron-LM requires. Pinned host buffers and copy streams exist only where
    there is a device to copy from."""
    if not optim.optimizer_cpu_offload:
        return {}
    if dtype == torch.float32:  # config/rules.py::check_host_optimizer says so before a run starts
        raise ValueError("optim.optimizer_cpu_offload steps a bf16 or fp16 model's shards, not float32 ones: set "
                         "model.dtype=bfloat16, or optim.optimizer_cpu_offload=false")
    on_device = device.type != "cpu"
    if on_device and optim.optimizer_offload_fraction < 1.0:
        from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

        if USING_PYTORCH_OPTIMIZER:
            # Its device and host optimizers are then the same class (torch's AdamW), and a checkpoint load moves
            # the device optimizer's state to the host by that class (hybrid_optimizer._move_new_state_to_right_device).
            raise ValueError(
                f"optim.optimizer_offload_fraction={optim.optimizer_offload_fraction} needs TransformerEngine's or "
                "apex's FusedAdam for the device share: install one, or set optim.optimizer_offload_fraction=1.0")
    return dict(
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=optim.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=optim.overlap_cpu_optimizer_d2h_h2d and on_device,
        use_precision_aware_optimizer=True,
        pin_cpu_grads=on_device,
        pin_cpu_params=on_device,
    )


def decay_horizon(optim: OptimConfig, run_optimizer_steps: int | None) -> int | None:
    """The LR schedule's length: ``<worker>.optim.total_training_steps`` when set (> 0), else the run's optimizer steps."""
    return optim.total_training_steps if optim.total_training_steps > 0 else run_optimizer_steps


def wrap_ddp(chunks: list[Any], tcfg: Any, dtype: torch.dtype, use_distributed_optimizer: bool) -> list[Any]:
    """``chunks`` wrapped for training: ``Float16Module`` (bf16/fp16) inside Megatron's DDP, one per chunk."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        if dtype != torch.float32:
            chunk = Float16Module(tcfg, chunk)  # casts inputs/outputs at the chunk boundary
        # Only the first chunk gets buckets of its own (Megatron-LM convention with VPP).
        wrapped.append(DistributedDataParallel(tcfg, ddp_config, chunk, disable_bucketing=i > 0))
    return wrapped


def build_optimizer(
    chunks: list[Any], optim: OptimConfig, tcfg: Any, *, dtype: torch.dtype, device: torch.device,
    use_distributed_optimizer: bool, total_steps: int | None,
) -> tuple[Any, Any]:
    """``(optimizer, scheduler)`` of the DDP-wrapped ``chunks``; with fp16 it sets ``tcfg.grad_scale_func``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.floor_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
        # fp16: dynamic loss scaling from PyTorch's GradScaler start (Megatron's 2^32 overflows fp16 gradients
        # and skips the first ~30 optimizer steps while it backs off: an RL run's first steps are precious).
        initial_loss_scale=2.0**16,
        **host_optimizer_kwargs(optim, device, dtype),
    )
    optimizer = get_megatron_optimizer(ocfg, chunks)
    if ocfg.fp16:
        # The schedule scales each micro-batch's loss only through grad_scale_func, and the optimizer unscales the
        # gradients by the scaler's scale: without it every fp16 gradient is 2^-16 too small (Megatron-LM's
        # training loop sets it the same way).
        tcfg.grad_scale_func = optimizer.scale_loss
    total = decay_horizon(optim, total_steps)
    if total is None or total <= 0:
        if optim.lr_decay_style != "constant":
            raise ValueError(
                f"optim.lr_decay_style={optim.lr_decay_style!r} needs optim.total_training_steps "
                "(or the trainer's step count): set it, or use constant"
            )
        total = 10**9  # constant LR: the decay horizon never matters
    warmup = optim.warmup_steps(total)
    if warmup >= total:
        raise ValueError(f"optim.lr_warmup_steps={warmup} must be < total_training_steps={total}")
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.floor_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=total,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


__all__: Sequence[str] = ["build_optimizer", "decay_horizon", "host_optimizer_kwargs", "wrap_ddp"]
