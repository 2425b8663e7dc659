"""A real Megatron training setup for the models acceptance tests: bridge-built chunks with HF weights,
DDP with the distributed optimizer, Adam with clipping, and one forward_backward step on a fixed global batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.unit.models._hf_fixtures import VOCAB

SEQ, GLOBAL_BATCH = 16, 4


@dataclass
class Trainable:
    bridge: Any
    chunks: list[Any]  # the GPTModel chunks (what the bridge exports and dist_checkpointing shards)
    model: list[Any]  # the same chunks wrapped in Megatron DDP
    optimizer: Any


def build_trainable(
    par: ParallelConfig, path: str, hf_state: Any = None, *, lr: float = 0.1, **tcfg_overrides: Any
) -> Trainable:
    """Parallel state for ``par``, the model with ``hf_state`` (default: the checkpoint at ``path``), DDP, optimizer.
    ``tcfg_overrides``: TransformerConfig fields (an MoE load-balancing loss, say)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.layout import initialize_parallel

    initialize_parallel(par, seed=1234)
    hf_config = load_hf_config(path)
    bridge = get_bridge(hf_config)
    tcfg = bridge.transformer_config(hf_config, par, **tcfg_overrides)
    tcfg.finalize_model_grads_func = finalize_model_grads  # DP grad reduction + tied-embedding sync across stages
    chunks = bridge.build_model(hf_config, tcfg)
    bridge.load_hf_weights(chunks, path if hf_state is None else hf_state)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = [DistributedDataParallel(tcfg, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    # Adam's first step is ~lr*sign(grad); a large eps makes it proportional to the gradient so rounding noise in
    # tiny gradients cannot flip whole updates between layouts (same optimizer code path).
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, adam_eps=1.0, weight_decay=0.0, clip_grad=1.0,
            use_distributed_optimizer=True, params_dtype=torch.float32,
        ),
        model,
    )
    return Trainable(bridge, chunks, model, optimizer)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_step(t: Trainable, step: int = 0) -> dict[str, Any]:
    """One optimizer step on global batch ``step``: DP rank r takes rows [r*B/dp, (r+1)*B/dp) as micro-batches of 1.

    Megatron divides each micro-batch loss by the number of micro-batches and DDP averages over DP,
    so every layout minimises the same mean loss.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcore_agentic.parallel.cp_split import cp_positions, cp_split

    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens, labels = global_batch(step)
    positions = torch.arange(SEQ).unsqueeze(0)
    cp_size = ps.get_context_parallel_world_size()
    if cp_size > 1:  # each CP rank holds chunks r and 2*CP-1-r of every sequence (DDP averages over DP x CP)
        cp_rank = ps.get_context_parallel_rank()
        tokens, labels = (cp_split(x, cp_size, cp_rank, seq_dim=1) for x in (tokens, labels))
        positions = cp_positions(SEQ, cp_size, cp_rank).unsqueeze(0)
    rows = GLOBAL_BATCH // dp_size
    micro_batches = iter([(tokens[i : i + 1], labels[i : i + 1]) for i in range(dp_rank * rows, (dp_rank + 1) * rows)])

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        # (sum, token count, report): the schedule divides by the count and the micro-batch number. (The legacy
        # 2-tuple form is instead multiplied by the CP size, expecting each CP rank's share of the global mean.)
        total = per_token_loss.float().sum()
        count = torch.tensor(per_token_loss.numel(), dtype=torch.int)  # the schedules sum counts in int
        return total, count, {"loss": (total / count).detach()}

    def forward_step(data_iterator, chunk):
        tok, lab = next(data_iterator)
        return chunk(tok, positions, None, labels=lab), loss_func

    for chunk in t.model:
        chunk.zero_grad_buffer()
    t.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=micro_batches, model=t.model, num_microbatches=rows,
        seq_length=SEQ // cp_size, micro_batch_size=1, forward_only=False,
    )
    ok, grad_norm, _ = t.optimizer.step()
    return {"ok": ok, "grad_norm": grad_norm, "losses": [float(x["loss"]) for x in losses]}


def export(t: Trainable) -> dict[str, torch.Tensor]:
    """Full HF-named tensors (identical on every rank)."""
    return dict(t.bridge.export_hf_weights(t.chunks))
