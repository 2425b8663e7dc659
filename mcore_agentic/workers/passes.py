"""What every worker does over a batch: check its keys, read log-probs off the logits, run PPO epochs.

Shared by :class:`~mcore_agentic.workers.actor.Actor`, :class:`~mcore_agentic.workers.critic.Critic`
and :class:`~mcore_agentic.workers.reference.Reference`, so each of those holds only its own model
and loss. Log-probs come from TP-sharded logits through the vocab-parallel kernels (the full
vocabulary is never gathered; ids past the engine's ``vocab_size`` are excluded).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from mcore_agentic.algorithms.losses import LossNormalisers, loss_normalisers
from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.vocab_parallel import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy
from mcore_agentic.workers.engine import HeadFn, LossFn, MegatronEngine, MicroBatching

MODEL_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "response_mask")
"""The batch keys every model forward reads (see :mod:`mcore_agentic.data.batch`)."""


def require_keys(batch: Batch, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{what} needs batch keys {missing}; it has {sorted(batch.tensors)}")


def log_prob_head(engine: MegatronEngine, temperature: float, with_entropy: bool) -> HeadFn:
    """Per-token ``log_probs`` (and ``entropys``) of the next token from this rank's logits shard."""
    layout = engine.layout
    group = layout.tp_group() if layout.tensor_model_parallel_size > 1 else None

    def head(logits: torch.Tensor, mb) -> dict[str, torch.Tensor]:
        kwargs = dict(group=group, temperature=temperature, vocab_start_index=layout.tp_rank * logits.shape[-1],
                      vocab_size=engine.vocab_size)
        if with_entropy:
            lp, ent = vocab_parallel_log_probs_and_entropy(logits, mb.labels, **kwargs)
            return {"log_probs": lp, "entropys": ent}
        return {"log_probs": vocab_parallel_log_probs(logits, mb.labels, **kwargs)}

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
    engine: MegatronEngine,
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
    """``epochs`` passes over shuffled mini-batches of ``mini_batch_size`` sequences, one optimizer step each.

    Every loss term is normalised by the counts of its *whole* mini-batch (every rank holds it), so
    the result does not depend on the micro-batch split or the DP/CP layout. ``seed`` orders the
    shuffle (the workers pass ``cfg.seed +`` their update count). Returns the metrics
    averaged over the optimizer steps. ``mini_batch_size`` comes from the validated config
    (``config.rules``: it tiles the step's batch).
    """
    if len(batch) % mini_batch_size:
        raise ValueError(f"mini-batches of {mini_batch_size} sequences do not tile a batch of {len(batch)}")
    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(epochs):
        for mini in batch.iter_minibatches(mini_batch_size, shuffle=shuffle, generator=generator):
            engine.zero_grad()
            sums = engine.forward_backward(mini, head, make_loss(loss_normalisers(mini["response_mask"])), batching)
            records.append({**sums, **engine.step()})
    return mean_metrics(records)


__all__ = ["MODEL_KEYS", "log_prob_head", "mean_metrics", "ppo_epochs", "require_keys"]
