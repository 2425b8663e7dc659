"""``Actor``: the trained policy — old log-probs, the PPO update, and a loss-masked SFT step.

Log-probs come from TP-sharded logits through the vocab-parallel kernels (the full
vocabulary is never gathered; Megatron's padded vocabulary is excluded), of
``logits / temperature`` as the rollout sampled them. The update walks mini-batches
x ``ppo_epochs`` in a seeded order; each mini-batch is one optimizer step over
gradient-accumulated micro-batches, with every loss term normalised by counts of
the *whole* mini-batch, so the result does not depend on the micro-batch split or
the DP/CP layout.

Every method takes and returns the global batch (identical on every rank);
metrics are identical on every rank too.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from mcore_agentic.algorithms.losses import (
    LossNormalisers,
    agg_loss,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    loss_normalisers,
)
from mcore_agentic.config.errors import ConfigError
from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.vocab_parallel import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy
from mcore_agentic.workers.config import ActorConfig
from mcore_agentic.workers.engine import HeadFn, MegatronEngine, MicroBatch, MicroBatching

MODEL_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "response_mask")


def log_prob_head(engine: MegatronEngine, temperature: float, with_entropy: bool) -> HeadFn:
    """Per-token ``log_probs`` (and ``entropys``) of the next token from this rank's logits shard."""
    layout = engine.layout
    group = layout.tp_group() if layout.tensor_model_parallel_size > 1 else None

    def head(logits: torch.Tensor, mb: MicroBatch) -> dict[str, torch.Tensor]:
        start = layout.tp_rank * logits.shape[-1]
        if with_entropy:
            lp, ent = vocab_parallel_log_probs_and_entropy(
                logits, mb.labels, group=group, temperature=temperature, vocab_start_index=start,
                vocab_size=engine.vocab_size,
            )
            return {"log_probs": lp, "entropys": ent}
        lp = vocab_parallel_log_probs(
            logits, mb.labels, group=group, temperature=temperature, vocab_start_index=start,
            vocab_size=engine.vocab_size,
        )
        return {"log_probs": lp}

    return head


def require_keys(batch: Batch, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{what} needs batch keys {missing}; it has {sorted(batch.tensors)}")


def check_mini_batch(batch_size: int, mini: int, dp: int, group: str) -> None:
    """Mini-batches must tile the batch and split evenly over DP ranks."""
    if mini % dp:
        raise ConfigError(f"{group}.ppo_mini_batch_size", f"{mini} does not split over {dp} data-parallel ranks")
    if batch_size % mini:
        raise ConfigError(
            f"{group}.ppo_mini_batch_size",
            f"{mini} does not divide the batch of {batch_size} sequences: use a divisor of it",
        )


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the mini-batch updates (``lr``: the last value)."""
    acc: dict[str, list[float]] = defaultdict(list)
    for r in records:
        for k, v in r.items():
            acc[k].append(v)
    out = {k: sum(v) / len(v) for k, v in acc.items()}
    if "lr" in acc:
        out["lr"] = acc["lr"][-1]
    return out


class Actor:
    """The policy: a trainable :class:`MegatronEngine` plus the PPO and SFT losses."""

    def __init__(
        self,
        cfg: ActorConfig,
        *,
        model_path: str,
        dtype: str,
        layout: Any,
        temperature: float = 1.0,
        make_vocab_size_divisible_by: int = 128,
        transformer_impl: str = "auto",
        total_training_steps: int | None = None,
    ) -> None:
        if not temperature > 0:
            raise ConfigError("rollout.temperature", f"{temperature} must be > 0")
        self.cfg = cfg
        self.temperature = temperature
        self.engine = MegatronEngine(
            model_path=model_path,
            dtype=dtype,
            parallel=cfg.parallel,
            layout=layout,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            transformer_impl=transformer_impl,
            optim=cfg.optim,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            total_training_steps=total_training_steps,
        )
        self.batching = MicroBatching(
            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len=cfg.ppo_max_token_len_per_gpu,
            field="actor.ppo_max_token_len_per_gpu",
        )
        self._updates = 0

    # ------------------------------------------------------------------ forward
    def compute_log_prob(self, batch: Batch, *, calculate_entropy: bool = False) -> Batch:
        """``batch`` plus ``old_log_probs`` [B, R] (and ``entropys`` [B, R]); 0 on response padding."""
        require_keys(batch, MODEL_KEYS, "Actor.compute_log_prob")
        out = self.engine.forward_only(batch, log_prob_head(self.engine, self.temperature, calculate_entropy), self.batching)
        tensors = {"old_log_probs": out["log_probs"]}
        if calculate_entropy:
            tensors["entropys"] = out["entropys"]
        return batch.update(tensors)

    # ------------------------------------------------------------------ PPO update
    def _ppo_loss_fn(self, norms: LossNormalisers):
        pl = self.cfg.policy_loss
        agg = dict(global_tokens=norms.tokens, global_seqs=norms.seqs)

        def loss_fn(resp: dict[str, torch.Tensor], mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            d = mb.data
            mask = d["response_mask"]
            log_prob = resp["log_probs"]
            pol = compute_policy_loss(
                d["old_log_probs"], log_prob, d["advantages"], mask,
                clip_ratio_low=pl.clip_ratio_low, clip_ratio_high=pl.clip_ratio_high, clip_ratio_c=pl.clip_ratio_c,
                loss_agg_mode=pl.loss_agg_mode, loss_scale_factor=pl.loss_scale_factor, **agg,
            )
            entropy = compute_entropy_loss(
                resp["entropys"], mask, pl.loss_agg_mode, loss_scale_factor=pl.loss_scale_factor, **agg
            )
            loss = pol.pg_loss - pl.entropy_coeff * entropy
            # Local masked means -> this micro-batch's share of the mini-batch token mean.
            share = mask.sum().to(torch.float32) / max(norms.tokens, 1)
            metrics = {
                "pg_loss": pol.pg_loss.detach(),
                "entropy": entropy.detach(),
                "pg_clipfrac": pol.pg_clipfrac * share,
                "pg_clipfrac_lower": pol.pg_clipfrac_lower * share,
                "ppo_kl": pol.ppo_kl * share,
            }
            if pl.use_kl_loss:
                kl = compute_kl_loss(
                    log_prob, d["ref_log_probs"], mask, pl.kl_loss_type, pl.loss_agg_mode,
                    loss_scale_factor=pl.loss_scale_factor, **agg,
                )
                loss = loss + pl.kl_loss_coef * kl
                metrics["kl_loss"] = kl.detach()
            metrics["loss"] = loss.detach()
            return loss, metrics

        return loss_fn

    def update_policy(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; returns metrics averaged over the optimizer steps."""
        keys = MODEL_KEYS + ("old_log_probs", "advantages") + (("ref_log_probs",) if self.cfg.policy_loss.use_kl_loss else ())
        require_keys(batch, keys, "Actor.update_policy")
        check_mini_batch(len(batch), self.cfg.ppo_mini_batch_size, self.engine.layout.data_parallel_size, "actor")
        generator = torch.Generator().manual_seed(self.cfg.seed + self._updates)
        self._updates += 1
        head = log_prob_head(self.engine, self.temperature, with_entropy=True)
        records = []
        for _ in range(self.cfg.ppo_epochs):
            for mini in batch.iter_minibatches(self.cfg.ppo_mini_batch_size, shuffle=self.cfg.shuffle, generator=generator):
                norms = loss_normalisers(mini["response_mask"])  # whole mini-batch: every rank holds it
                self.engine.zero_grad()
                sums = self.engine.forward_backward(mini, head, self._ppo_loss_fn(norms), self.batching)
                records.append({**sums, **self.engine.step()})
        return mean_metrics(records)

    # ------------------------------------------------------------------ SFT
    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of token-mean cross entropy on ``response_mask`` tokens (temperature 1)."""
        require_keys(batch, MODEL_KEYS, "Actor.sft_step")
        norms = loss_normalisers(batch["response_mask"])
        head = log_prob_head(self.engine, 1.0, with_entropy=False)

        def loss_fn(resp: dict[str, torch.Tensor], mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = -agg_loss(resp["log_probs"], mb.data["response_mask"], "token-mean", global_tokens=norms.tokens)
            return loss, {"sft_loss": loss.detach()}

        self.engine.zero_grad()
        sums = self.engine.forward_backward(batch, head, loss_fn, self.batching)
        return {**sums, **self.engine.step()}

    # ------------------------------------------------------------------ weights / memory
    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Full HF tensors of the current policy (collective)."""
        return self.engine.export_hf_weights()

    def offload(self) -> int:
        """Move what the config's ``*_offload`` flags name off the device (colocated mode)."""
        return self.engine.offload(
            params=self.cfg.param_offload, grads=self.cfg.grad_offload, optimizer=self.cfg.optimizer_offload
        )

    def reload(self) -> int:
        return self.engine.reload()


__all__ = ["Actor", "log_prob_head"]
