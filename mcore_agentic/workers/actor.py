"""``Actor``: the trained policy — old log-probs, the PPO update, and a loss-masked SFT step.

Log-probs come from TP-sharded logits through the vocab-parallel kernels (the full
vocabulary is never gathered; Megatron's padded vocabulary is excluded), of
``logits / temperature`` as the rollout sampled them. The update walks mini-batches
x ``ppo_epochs`` in a seeded order; each mini-batch is one optimizer step over
gradient-accumulated micro-batches, with every loss term normalised by counts of
the *whole* mini-batch, so the result does not depend on the micro-batch split or
the DP/CP layout.

Every method takes and returns this DP replica's rows (every rank of the replica holds the
same ones, see :mod:`mcore_agentic.feed.distribute`), except :meth:`Actor.sft_step`, whose
batch every rank builds whole; metrics are identical on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from mcore_agentic.algorithms.config import DistillationConfig
from mcore_agentic.algorithms.losses import LossNormalisers, agg_loss, loss_normalisers
from mcore_agentic.algorithms.objective import TopKDistillation, actor_objective
from mcore_agentic.data.batch import Batch
from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.workers.config import ActorConfig
from mcore_agentic.workers.megatron_model import MegatronModel, MicroBatch, MicroBatching
from mcore_agentic.workers.passes import MODEL_KEYS, dp_share, log_prob_head, ppo_epochs, require_keys


class Actor:
    """The policy: a trainable :class:`MegatronModel` plus the PPO and SFT losses."""

    def __init__(
        self,
        cfg: ActorConfig,
        spec: ModelSpec,
        layout: ParallelLayout,
        *,
        mini_batch_sequences: int,
        total_training_steps: int | None = None,
    ) -> None:
        """``spec``: the run's model (its ``temperature`` is the one log-probs use, the rollout's);
        ``total_training_steps``: the run's optimizer steps (the LR schedule's horizon)."""
        self.cfg = cfg
        self.mini_batch_sequences = mini_batch_sequences
        """Sequences per optimizer step over all DP ranks: ``ppo_mini_batch_size`` counts *prompts* (verl);
        the trainer converts it once (``config.rules.PPOBatchSizes.mini_batch_sequences``: prompts x rollout.n)."""
        self.temperature = spec.temperature
        self.model = MegatronModel(
            spec,
            layout,
            optim=cfg.optim,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            total_training_steps=total_training_steps,
            moe=cfg.moe,
            recompute=cfg.recompute,
        )
        self.batching = MicroBatching(
            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len=cfg.ppo_max_token_len_per_gpu,
            field="actor.ppo_max_token_len_per_gpu",
            pack=spec.use_remove_padding,
        )
        self._updates = 0

    # ------------------------------------------------------------------ forward
    def compute_log_prob(self, batch: Batch, *, calculate_entropy: bool = False) -> Batch:
        """``batch`` plus ``old_log_probs`` [B, R] (and ``entropys`` [B, R]); 0 on response padding."""
        require_keys(batch, MODEL_KEYS, "Actor.compute_log_prob")
        head = log_prob_head(self.model, self.temperature, calculate_entropy)
        with self._routing(replay=self.cfg.moe.routing_replay == "rollout", measure=True):
            out = self.model.forward_only(batch, head, self.batching)
        tensors = {"old_log_probs": out["log_probs"]}
        if calculate_entropy:
            tensors["entropys"] = out["entropys"]
        return batch.update(tensors)

    # ------------------------------------------------------------------ PPO update
    def _ppo_loss_fn(self, norms: LossNormalisers, distill: TopKDistillation | None):
        def loss_fn(resp: dict[str, torch.Tensor], mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            d = mb.data
            out = actor_objective(
                self.cfg.policy_loss, norms, old_log_probs=d["old_log_probs"], log_probs=resp["log_probs"],
                entropys=resp["entropys"], advantages=d["advantages"], response_mask=d["response_mask"],
                ref_log_probs=d["ref_log_probs"] if "ref_log_probs" in d else None,
                rollout_is_weights=d["rollout_is_weights"] if "rollout_is_weights" in d else None,
                distill=dataclasses.replace(distill, student_log_probs=resp["candidate_log_probs"],
                                            teacher_log_probs=d["teacher_top_k_log_probs"]) if distill else None,
            )
            return out.loss, out.metrics

        return loss_fn

    def update_policy(
        self, batch: Batch, *, mini_batch_size: int | None = None, distillation: DistillationConfig | None = None
    ) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; returns metrics averaged over the optimizer steps.

        ``mini_batch_size``: this step's (sequences over all replicas) when its rows are not the configured step's
        (agent episodes that trained several samples: as many mini-batches, each holding its share).
        ``distillation``: ``algorithm.distillation`` when a teacher scored the rows; with its ``top_k`` the loss gains
        ``coef`` x the top-k KL to the teacher (the rows carry ``teacher_top_k_ids`` / ``_log_probs``)."""
        top_k = distillation is not None and distillation.top_k > 0
        keys = MODEL_KEYS + ("old_log_probs", "advantages") + (("ref_log_probs",) if self.cfg.policy_loss.use_kl_loss else ())
        keys += ("teacher_top_k_ids", "teacher_top_k_log_probs") if top_k else ()
        require_keys(batch, keys, "Actor.update_policy")
        distill = TopKDistillation(coef=distillation.coef, direction=distillation.kl) if top_k else None
        seed = self.cfg.seed + self._updates  # each update shuffles differently, reproducibly
        self._updates += 1
        with self._routing(replay=self.cfg.moe.routing_replay == "rollout", measure=False):
            metrics = ppo_epochs(
                self.model, batch, mini_batch_size=mini_batch_size or self.mini_batch_sequences, epochs=self.cfg.ppo_epochs,
                shuffle=self.cfg.shuffle, seed=seed,
                head=log_prob_head(self.model, self.temperature, True, candidates=top_k),
                make_loss=lambda norms: self._ppo_loss_fn(norms, distill), batching=self.batching,
            )
        # MoE: expert load over this step's actor passes (old log-probs and the updates); {} for a dense model.
        return {**metrics, **self.model.moe_metrics()}

    def routing_metrics(self) -> dict[str, float]:
        """``rollout/routing_agreement`` of the old-log-prob passes since the last call (``actor.moe.routing_replay``
        on a mixture-of-experts model; else {}). Collective over the world."""
        return self.model.routing.pop_agreement() if self.model.routing is not None else {}

    def _routing(self, *, replay: bool, measure: bool) -> Any:
        """A pass's routing replay switches (nothing for a dense model or ``actor.moe.routing_replay=disable``)."""
        if self.model.routing is None:
            return contextlib.nullcontext()
        return self.model.routing.use(replay=replay, measure=measure)

    # ------------------------------------------------------------------ SFT
    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of token-mean cross entropy on ``response_mask`` tokens (temperature 1).

        ``batch`` is the whole step's (every rank builds it from the same demonstrations); each DP
        replica trains its share."""
        require_keys(batch, MODEL_KEYS, "Actor.sft_step")
        norms = loss_normalisers(batch["response_mask"])
        head = log_prob_head(self.model, 1.0, with_entropy=False)

        def loss_fn(resp: dict[str, torch.Tensor], mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = -agg_loss(resp["log_probs"], mb.data["response_mask"], "token-mean", global_tokens=norms.tokens)
            return loss, {"sft_loss": loss.detach()}

        self.model.zero_grad()
        sums = self.model.forward_backward(dp_share(batch, self.model.layout), head, loss_fn, self.batching)
        return {**sums, **self.model.step()}

    # ------------------------------------------------------------------ weights / memory
    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Full HF tensors of the current policy (collective)."""
        return self.model.export_hf_weights()

    # ------------------------------------------------------------------ rollout-time offload (verl's actor.*_offload)
    def offload_before_export(self) -> int:
        """Gradient buffers and optimizer state off the device (``actor.grad_offload`` / ``optimizer_offload``):
        the weight export does not read them. Parameters left offloaded come back, the export reads them."""
        if self.model.offloader.is_offloaded("params"):
            self.model.offloader.reload("params")
        return self.model.offload(params=False, grads=self.cfg.grad_offload, optimizer=self.cfg.optimizer_offload)

    def offload_after_export(self) -> int:
        """Parameters off the device while the rollout runs (``actor.param_offload``)."""
        return self.model.offload(params=self.cfg.param_offload, grads=False, optimizer=False)

    def reload(self) -> int:
        """Everything offloaded back on the device."""
        return self.model.reload()


__all__ = ["Actor"]
