"""What every worker does over a batch: check its keys, read log-probs off the logits, run PPO epochs.

Shared by :class:`~mcore_agentic.workers.actor.Actor`, :class:`~mcore_agentic.workers.critic.Critic`
and :class:`~mcore_agentic.workers.reference.Reference`, so each of those holds only its own model
and loss. Log-probs come from TP-sharded logits through the vocab-parallel kernels (the full
vocabulary is never gathered; ids past the model's ``vocab_size`` are excluded).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from mcore_agentic.algorithms.losses import LossNormalisers, loss_normalisers
from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel import comm
from mcore_agentic.parallel.chunked_logits import HiddenStates
from mcore_agentic.parallel.vocab_parallel import (
    vocab_parallel_log_probs_at,
    vocab_parallel_top_k,
)
from mcore_agentic.workers.megatron_model import HeadFn, LossFn, MegatronModel, MicroBatching

MODEL_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "response_mask")
"""The batch keys every model forward reads (see :mod:`mcore_agentic.data.batch`)."""


def require_keys(batch: Batch, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{what} needs batch keys {missing}; it has {sorted(batch.tensors)}")


def dp_share(batch: Batch, layout: Any) -> Batch:
    """This DP replica's contiguous share of a batch every rank holds whole (the SFT warm start's)."""
    dp = layout.data_parallel_size
    if len(batch) % dp:
        raise ValueError(f"batch of {len(batch)} sequences does not split over {dp} data-parallel ranks")
    return batch.chunk(dp)[layout.dp_rank]


def global_normalisers(response_mask: torch.Tensor, layout: Any) -> LossNormalisers:
    """Token and sequence counts of a mini-batch whose rows are spread over the DP replicas (one all-reduce)."""
    local = loss_normalisers(response_mask)
    if layout.data_parallel_size == 1:
        return local
    counts = comm.all_reduce_host(comm.to_host([local.tokens, local.seqs], torch.long), group=layout.dp_group())
    return LossNormalisers(tokens=int(counts[0]), seqs=int(counts[1]))


def log_prob_head(
    model: MegatronModel, temperature: float, with_entropy: bool, *, top_k: int = 0, candidates: bool = False
) -> HeadFn:
    """Per-token ``log_probs`` (and ``entropys``) of the next token from this rank's logits shard.

    ``top_k``: also the ``k`` most likely next tokens, ``top_k_log_probs`` and ``top_k_ids`` ``[..., k]`` (a
    distillation teacher's). ``candidates``: also ``candidate_log_probs`` ``[..., k]``, differentiable, at the
    micro-batch's :attr:`~mcore_agentic.workers.micro_batch.MicroBatch.candidates` (the student's at its teacher's
    top k)."""
    layout = model.layout
    group = layout.tp_group() if layout.tensor_model_parallel_size > 1 else None

    def from_logits(logits: torch.Tensor, mb, positions: slice) -> dict[str, torch.Tensor]:
        kwargs = dict(group=group, temperature=temperature, vocab_start_index=layout.tp_rank * logits.shape[-1],
                      vocab_size=model.vocab_size)
        labels = mb.labels[:, positions]
        if top_k:  # a teacher: its top k and the sampled tokens' log-probs from one pass (no gradient)
            if with_entropy or candidates:
                raise ValueError("a top-k head scores a frozen teacher: no entropy, no candidates")
            top_lp, top_ids, lp = vocab_parallel_top_k(logits, top_k, target=labels, **kwargs)
            return {"log_probs": lp, "top_k_log_probs": top_lp, "top_k_ids": top_ids}
        # The label and the teacher's candidates as one [..., 1 + k] target: one pass, with the entropy's sums.
        ids = labels.unsqueeze(-1)
        if candidates:
            if mb.candidates is None:
                raise KeyError("candidate log-probs need the rows' teacher_top_k_ids (algorithm.distillation.top_k)")
            ids = torch.cat([ids, mb.candidates[:, positions].to(ids.dtype)], dim=-1)
        lp, ent = vocab_parallel_log_probs_at(logits, ids, with_entropy=with_entropy, **kwargs)
        out = {"log_probs": lp[..., 0]}
        if with_entropy:
            out["entropys"] = ent
        if candidates:
            out["candidate_log_probs"] = lp[..., 1:]
        return out

    def head(output: torch.Tensor | HiddenStates, mb) -> dict[str, torch.Tensor]:
        if isinstance(output, HiddenStates):  # logits made a chunk of tokens at a time (model.logits_chunk_mb)
            return output.per_token(lambda logits, positions: from_logits(logits, mb, positions))
        return from_logits(output, mb, slice(None))

    return head


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the optimizer steps (``lr``: the last value)."""
    acc: dict[str, list[float]] = defaultdict(list)
    for r in records:
        for k, v in r.items():
            acc[k].append(v)
    out = {k: sum(v) / len(v) for k, v in acc.items()}
    if "lr" in acc:
        out["lr"] = acc["lr"][-1]
    return out


def ppo_epochs(
    model: MegatronModel,
    batch: Batch,
    *,
    mini_batch_size: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    head: HeadFn,
    make_loss: Callable[[LossNormalisers], LossFn],
    batching: MicroBatching,
) -> dict[str, float]:
    """``epochs`` passes over the mini-batches of this replica's rows ``batch``, one optimizer step each.

    ``mini_batch_size`` counts sequences over all DP replicas; each replica holds an equal
    share of every mini-batch. The first epoch takes the rows in order, as consecutive blocks:
    :mod:`mcore_agentic.feed.distribute` deals each replica its rows mini-batch by mini-batch,
    from a seeded shuffle of the whole step, so a mini-batch is the same set of rows whatever
    the DP layout. Later epochs (with ``shuffle``) re-cut the replica's rows in a ``seed``-ed
    order. Every loss term is normalised by the counts of the *whole* mini-batch (all-reduced
    over DP), so the result does not depend on the micro-batch split or the DP/CP layout.
    Returns the metrics averaged over the optimizer steps.
    """
    dp = model.layout.data_parallel_size
    if mini_batch_size % dp or len(batch) % (mini_batch_size // dp):
        raise ValueError(
            f"mini-batches of {mini_batch_size} sequences over {dp} data-parallel replicas do not tile "
            f"this replica's {len(batch)} rows"
        )
    local_size = mini_batch_size // dp
    generator = torch.Generator().manual_seed(seed)
    records = []
    for epoch in range(epochs):
        for mini in batch.iter_minibatches(local_size, shuffle=shuffle and epoch > 0, generator=generator):
            model.zero_grad()
            norms = global_normalisers(mini["response_mask"], model.layout)
            sums = model.forward_backward(mini, head, make_loss(norms), batching)
            records.append({**sums, **model.step()})
    return mean_metrics(records)


__all__ = ["MODEL_KEYS", "dp_share", "global_normalisers", "log_prob_head", "mean_metrics", "ppo_epochs", "require_keys"]
