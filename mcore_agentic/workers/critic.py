"""``Critic``: the value model — the actor's architecture with a scalar head; values and the clipped value update.

The body is a Megatron ``GPTModel`` built and loaded by the bridge from an HF
checkpoint (normally the actor's). On the last pipeline stage its vocabulary
``output_layer`` is swapped for :class:`ValueHead`, a ``Linear(hidden, 1)``
starting at zero. No tensor parallelism is needed in the head: the hidden state
after the final norm is replicated over the TP group, so every TP rank holds the
same head and computes the same values (the gradient-norm code counts a replicated
parameter once, on TP rank 0). Under sequence parallelism each TP rank holds only
its ``s / tp`` slice of that state: the head all-gathers it over TP first, as the
vocabulary output layer it replaces does, so values cover the whole sequence.

The value of response token j is read at the position *before* it (the state the
token was sampled from), as for log-probs (see :mod:`sequence`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mcore_agentic.algorithms.losses import LossNormalisers
from mcore_agentic.algorithms.objective import critic_objective
from mcore_agentic.data.batch import Batch
from mcore_agentic.models.bridge import unwrap_model
from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.workers.config import CriticConfig
from mcore_agentic.workers.megatron_model import MegatronModel, MicroBatch, MicroBatching
from mcore_agentic.workers.passes import MODEL_KEYS, ppo_epochs, require_keys


class ValueHead(torch.nn.Module):
    """``Linear(hidden, 1, bias=False)`` called the way GPTModel calls its output layer.

    ``sequence_parallel``: the hidden states arrive scattered over ``tp_group`` along the sequence (``[s/tp, b, h]``)
    and are all-gathered first. The same name as on megatron's output layer, which GPTModel reads.
    """

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, device: torch.device, *, sequence_parallel: bool = False,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # [s/tp, b, h] -> [s, b, h]. Every TP rank then computes the same values and loss, so the backward
            # only slices the gradient back (tensor_parallel_output_grad=False), where the vocabulary-parallel
            # output layer, whose ranks each hold part of the logits, reduce-scatters it.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        # [s, b, h] -> [s, b, 1]; GPTModel returns it as [b, s, 1]. ``weight`` (tied embeddings) is ignored.
        return torch.nn.functional.linear(hidden_states, self.weight), None


def _attach_value_heads(chunks: list[Any]) -> None:
    for chunk in chunks:
        model = unwrap_model(chunk)
        # No output weight shared with the embedding any more (no tied-embedding grad all-reduce).
        model.share_embeddings_and_output_weights = False
        if model.post_process:
            old = model.output_layer  # its weight is None with tied embeddings at PP=1 (the embedding's is used)
            model.output_layer = ValueHead(
                model.config.hidden_size, model.config.params_dtype, next(model.parameters()).device,
                # megatron's output layer turns it off at TP=1 (nothing to gather)
                sequence_parallel=bool(getattr(old, "sequence_parallel", False)), tp_group=getattr(old, "tp_group", None),
            )


class Critic:
    """A trainable :class:`MegatronModel` with a value head plus the clipped value loss."""

    def __init__(
        self,
        cfg: CriticConfig,
        spec: ModelSpec,
        layout: ParallelLayout,
        *,
        mini_batch_sequences: int,
        total_training_steps: int | None = None,
    ) -> None:
        """``spec``: the run's model; the body starts from ``critic.model_path`` when that is set, else from
        ``spec.model_path``."""
        self.cfg = cfg
        self.mini_batch_sequences = mini_batch_sequences
        """Sequences per optimizer step over all DP ranks (see ``Actor.mini_batch_sequences``)."""
        self.model = MegatronModel(
            dataclasses.replace(spec, model_path=cfg.model_path) if cfg.model_path else spec,
            layout,
            optim=cfg.optim,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            total_training_steps=total_training_steps,
            customize=_attach_value_heads,
            lm_head=False,  # the value head sits where the LM head was: the body's export skips it
            recompute=cfg.recompute,
            role="critic",
        )
        self.batching = MicroBatching(
            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len=cfg.ppo_max_token_len_per_gpu,
            field="critic.ppo_max_token_len_per_gpu",
            pack=spec.use_remove_padding,
        )
        self._updates = 0

    @staticmethod
    def _head(output: torch.Tensor, mb: MicroBatch) -> dict[str, torch.Tensor]:
        return {"values": output.squeeze(-1).float()}

    def compute_values(self, batch: Batch) -> Batch:
        """``batch`` plus ``values`` [B, R] (0 on response padding)."""
        require_keys(batch, MODEL_KEYS, "Critic.compute_values")
        out = self.model.forward_only(batch, self._head, self.batching)
        return batch.update({"values": out["values"]})

    def _loss_fn(self, norms: LossNormalisers):
        def loss_fn(resp: dict[str, torch.Tensor], mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            d = mb.data
            out = critic_objective(
                self.cfg.value_loss, norms, vpreds=resp["values"], returns=d["returns"], values=d["values"],
                response_mask=d["response_mask"],
            )
            return out.loss, out.metrics

        return loss_fn

    def update_critic(self, batch: Batch, *, mini_batch_size: int | None = None) -> dict[str, float]:
        """Epochs over shuffled mini-batches of the clipped value loss; metrics averaged over steps.

        ``mini_batch_size``: this step's (sequences over all replicas) when its rows are not the configured step's
        (agent episodes that trained several samples: as many mini-batches, each holding its share)."""
        require_keys(batch, MODEL_KEYS + ("values", "returns"), "Critic.update_critic")
        seed = self.cfg.seed + self._updates  # each update shuffles differently, reproducibly
        self._updates += 1
        return ppo_epochs(
            self.model, batch, mini_batch_size=mini_batch_size or self.mini_batch_sequences, epochs=self.cfg.ppo_epochs,
            shuffle=self.cfg.shuffle, seed=seed, head=self._head, make_loss=self._loss_fn,
            batching=self.batching,
        )

    def offload(self) -> int:
        return self.model.offload(
            params=self.cfg.param_offload, grads=self.cfg.grad_offload, optimizer=self.cfg.optimizer_offload
        )

    def reload(self) -> int:
        return self.model.reload()


__all__ = ["Critic", "ValueHead"]
