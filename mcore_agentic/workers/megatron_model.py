"""``MegatronModel``: one Megatron model on this rank — build, forward-only and forward-backward, step.

The actor, critic, reference and teacher each own one (their ``.model``); it knows nothing
about RL. Its DDP wrapper, optimizer and LR scheduler are built by :mod:`.optimizer`, its
micro-batches by :mod:`.micro_batch` and :mod:`.sequence`. It

* builds this rank's model chunk(s) through the HF bridge and loads the HF
  checkpoint, then (if trained) wraps them in Megatron DDP and builds the
  Megatron optimizer and LR scheduler;
* takes *this DP replica's rows* (every rank of the replica holds the same ones, see
  :mod:`mcore_agentic.feed.distribute`), cuts them into micro-batches (fixed size or a
  token budget; with a budget every DP replica runs the same number), packs each into one
  THD sequence with ``cu_seqlens`` (or pads it, ``use_remove_padding=false``), splits each
  row over CP in Megatron's load-balanced layout, and runs Megatron's pipeline schedule
  (``get_forward_backward_func``);
* on the last pipeline stage hands the model output of each micro-batch to the
  caller's ``head_fn`` (per-token tensors of the local CP shard, e.g. log-probs),
  gathers those over CP, maps them to the ``[b, R]`` response layout and either
  returns them (forward-only: broadcast over PP, so every rank of the replica returns
  its replica's rows) or passes them to the caller's ``loss_fn``.

Loss scaling. ``calculate_per_token_loss`` is on, so Megatron neither divides
the loss by the number of micro-batches nor averages gradients over DP x CP:
gradients are *summed*. ``loss_fn`` must therefore return each micro-batch's
share of the mini-batch loss, normalised by a *global* count (all tokens of the
mini-batch over all DP ranks): then the summed gradient is the gradient of the
mini-batch loss whatever the micro-batch split or DP/CP layout. Every CP rank
computes the same loss on the CP-gathered outputs; ``cp_gather(grad_mode="slice")``
gives each its own tokens' gradient, and the DP x CP sum completes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.data.batch import Batch
from mcore_agentic.models.deferred_logits import defer_output_layer, output_weight
from mcore_agentic.models.spec import ModelSpec, logits_chunk_tokens
from mcore_agentic.parallel import comm
from mcore_agentic.parallel.chunked_logits import HiddenStates
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.parallel.own_layout import OwnLayout
from mcore_agentic.workers.config import OptimConfig, RecomputeConfig
from mcore_agentic.workers.micro_batch import (
    HeadFn,
    LossFn,
    MicroBatch,
    MicroBatching,
    build_micro_batch,
    merge_outputs,
    post_process,
    rows_in_order,
    sum_metrics,
    to_device,
)
from mcore_agentic.workers.offload import Offloader, model_grad_tensors, model_param_tensors, optimizer_tensors
from mcore_agentic.workers.optimizer import build_optimizer, wrap_ddp
from mcore_agentic.workers.sequence import (
    fixed_micro_batches,
    packed_budget_count,
    packed_budget_micro_batches,
    padded_budget_micro_batches,
    segment_lengths,
)


def check_layout(parallel: ParallelConfig, layout: ParallelLayout) -> None:
    """Refuse a model split (``spec.parallel``) other than the process groups' (``layout``): Megatron keeps one
    layout per process, and a model built for other sizes would wait in collectives its peers never join."""
    pairs = {
        "tensor_model_parallel_size": (parallel.tensor_model_parallel_size, layout.tensor_model_parallel_size),
        "pipeline_model_parallel_size": (parallel.pipeline_model_parallel_size, layout.pipeline_model_parallel_size),
        "virtual_pipeline_model_parallel_size": (parallel.virtual_pipeline_model_parallel_size or 1,
                                                 layout.virtual_pipeline_model_parallel_size or 1),
        "context_parallel_size": (parallel.context_parallel_size, layout.context_parallel_size),
        "expert_model_parallel_size": (parallel.expert_model_parallel_size, layout.expert_model_parallel_size),
    }
    wrong = [f"{name}={mine} but the process groups have {theirs}" for name, (mine, theirs) in pairs.items()
             if mine != theirs]
    if wrong:
        raise ValueError(f"the model spec's parallel sizes differ from the layout's: {'; '.join(wrong)} (build the "
                         "spec with the ParallelConfig the layout was initialised with)")


class MegatronModel:
    """This rank's chunk(s) of one Megatron GPT model, optionally with DDP, optimizer and LR scheduler.

    ``spec``: the run's model (checkpoint, dtype, layer spec, vocabulary, parallel sizes); ``layout``: this
    process's parallel layout, whose process groups the model is built with. ``customize(chunks)`` runs after
    the HF weights are loaded and before DDP wrapping (the critic swaps its output layer for a value head there).
    ``moe``: the actor's ``actor.moe`` (router losses, routing replay) of a mixture-of-experts model.
    ``recompute``: the activation recomputation of a trained model (``<role>.recompute_*``), megatron-core's own; it
    acts in the passes that keep activations for a backward pass (a forward-only pass keeps none).
    """

    def __init__(
        self,
        spec: ModelSpec,
        layout: ParallelLayout,
        *,
        optim: OptimConfig | None = None,
        use_distributed_optimizer: bool = True,
        total_training_steps: int | None = None,
        customize: Callable[[list[Any]], None] | None = None,
        lm_head: bool = True,
        moe: Any = None,
        recompute: RecomputeConfig | None = None,
        role: str = "actor",
    ) -> None:
        """Log-probs normalise over ``spec.vocab_size`` ids — the tokenizer's, which the rollout engine samples
        from (a checkpoint's embedding table may be padded past it, and a softmax over ids the engine never samples
        would shift every log-prob against the engine's); None: the checkpoint's."""
        from mcore_agentic.models.hf_io import load_hf_config
        from mcore_agentic.models.registry import get_bridge

        parallel = spec.parallel
        check_layout(parallel, layout)
        self.spec = spec
        self.layout = layout
        self.parallel = parallel
        self.dtype = spec.torch_dtype
        self.device = comm.compute_device()  # where the model, the micro-batches and the loss live
        self.hf_config = load_hf_config(spec.model_path)
        self.bridge = get_bridge(
            self.hf_config, make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by, lm_head=lm_head
        )
        rows = int(self.hf_config.vocab_size)
        self.vocab_size = rows if spec.vocab_size is None else min(rows, spec.vocab_size)
        from mcore_agentic.models.transformer_impl import use_te_for

        use_te = use_te_for(spec.transformer_impl)
        self.tcfg = self._transformer_config(use_te, moe, recompute, role, trained=optim is not None)
        # The layout's process groups (TP, PP, CP, DP, EP): the bridge's load and export read them off the model.
        chunks = self.bridge.build_model(self.hf_config, self.tcfg, use_te=use_te, pg_collection=layout.process_groups())
        self.bridge.load_hf_weights(chunks, spec.model_path)
        if customize is not None:
            customize(chunks)
        # Logits a chunk of tokens at a time (model.logits_chunk_mb): the last stage's model returns the output
        # layer's input and the head makes the logits itself (a value head, which replaced the layer, is kept).
        self.logits_chunk_tokens = 0
        if spec.logits_chunk_mb > 0 and any([defer_output_layer(chunk) for chunk in chunks]):
            tp = parallel.tensor_model_parallel_size
            vocab_local = self.bridge.padded_vocab_size(tp) // tp
            self.logits_chunk_tokens = logits_chunk_tokens(spec.logits_chunk_mb, vocab_local)
        self.trainable = optim is not None
        self.optimizer = None
        self.scheduler = None
        if self.trainable:
            chunks = wrap_ddp(chunks, self.tcfg, self.dtype, use_distributed_optimizer)
            self.optimizer, self.scheduler = build_optimizer(
                chunks, optim, self.tcfg, dtype=self.dtype, device=self.device,
                use_distributed_optimizer=use_distributed_optimizer, total_steps=total_training_steps,
            )
        else:
            for chunk in chunks:
                chunk.requires_grad_(False)
        self.chunks: list[Any] = chunks
        self.offloader = Offloader()
        from mcore_agentic.workers.moe_load import RouterLoad

        self.router_load = RouterLoad(chunks)  # mixture-of-experts models: tokens per expert (no hooks otherwise)
        self.is_moe = self.router_load.enabled
        self.routing: Any = None  # routing replay (actor.moe.routing_replay) of a mixture-of-experts model
        if moe is not None and getattr(moe, "routing_replay", "disable") != "disable" and self.is_moe:
            from mcore_agentic.workers.routing_replay import RoutingReplay

            self.routing = RoutingReplay(
                chunks, sequence_parallel=bool(self.tcfg.sequence_parallel),
                tp_size=layout.tensor_model_parallel_size, tp_rank=layout.tp_rank,
            )

    # ------------------------------------------------------------------ build
    def _transformer_config(self, use_te: bool, moe: Any, recompute: RecomputeConfig | None, role: str, *,
                            trained: bool) -> Any:
        """megatron-core's ``TransformerConfig`` of the model: the bridge's mapping of the checkpoint's config, with
        what this trainer's micro-batches, schedules and losses need; sets :attr:`offsets_on_device`."""
        from mcore_agentic.models.transformer_impl import te_spec_here, thd_offsets_on_host

        parallel = self.parallel
        interleaved = (parallel.virtual_pipeline_model_parallel_size or 1) > 1
        # The local spec reads packed offsets as host integers in every layer; TE's kernels read them on the device.
        self.offsets_on_device = not thd_offsets_on_host(te_spec_here(use_te))
        return self.bridge.transformer_config(
            self.hf_config,
            parallel,
            params_dtype=self.dtype,
            use_te=use_te,  # the GPU fusions follow the spec the model is built with
            # Gradients are summed (no 1/num_microbatches, no DP averaging): loss_fn normalises globally.
            calculate_per_token_loss=True,
            # Micro-batches have different padded lengths / row counts: PP exchanges shapes first. Not with
            # the interleaved (VPP) schedule: its shape exchange with variable lengths pairs tensors of the
            # wrong micro-batches; every micro-batch of a step gets the same shape instead (see
            # micro_batches), announced through seq_length/micro_batch_size.
            variable_seq_lengths=not interleaved,
            # Megatron refuses variable lengths with its default (allgather) MoE token dispatcher, even for
            # a dense model that has none; alltoall is the dispatcher that supports them.
            moe_token_dispatcher_type="alltoall",
            # gloo matches a batched isend/irecv pair by (peer, tag) only; with VPP over PP=2 the next and
            # previous stage are the same peer, so an activation and a gradient sent in one batch can swap.
            # Unbatched p2p posts sends/recvs in Megatron's even/odd order instead.
            batch_p2p_comm=not (interleaved and not torch.cuda.is_available()),
            **self._moe_overrides(moe),
            **self._recompute_overrides(recompute, role, trained=trained),
        )

    def _moe_overrides(self, moe: Any) -> dict[str, Any]:
        """Router-loss settings of ``actor.moe`` for a mixture-of-experts model; {} for a dense one or none given."""
        self.moe_losses = (0.0, 0.0)
        if moe is None or not int(getattr(self.hf_config, "num_experts", 0) or 0):
            return {}
        self.moe_losses = (float(moe.aux_loss_coeff), float(moe.z_loss_coeff))
        aux, z = self.moe_losses
        return {
            "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
            "moe_aux_loss_coeff": aux,
            "moe_z_loss_coeff": z if z > 0 else None,
        }

    def _recompute_overrides(self, recompute: RecomputeConfig | None, role: str, *, trained: bool) -> dict[str, Any]:
        """megatron-core's recomputation fields for a trained model (a frozen one has no backward pass)."""
        if recompute is None or not trained:
            return {}
        parallel = self.parallel
        chunks = parallel.pipeline_model_parallel_size * (parallel.virtual_pipeline_model_parallel_size or 1)
        recompute.check_split(int(self.hf_config.num_hidden_layers) // chunks, role)
        return recompute.megatron_kwargs()

    # ------------------------------------------------------------------ batching
    def micro_batches(self, batch: Batch, batching: MicroBatching) -> tuple[list[list[int]], list[MicroBatch]]:
        """Row groups and their prepared micro-batches for this replica's rows ``batch``.

        With a token budget, packed micro-batches are as few as fit (balanced by tokens) and every DP
        replica runs the same number (one all-reduce of one integer over the DP group).
        """
        cp, multiple = self.layout.context_parallel_size, self._length_multiple
        vpp = len(self.chunks) > 1
        segments = segment_lengths(batch["attention_mask"], cp_size=cp, multiple_of=multiple)
        if batching.use_dynamic_bsz and batching.pack:
            groups = packed_budget_micro_batches(segments, self._agreed_count(segments, batching))
        elif batching.use_dynamic_bsz:
            if vpp:
                raise ValueError("virtual pipeline stages need equal micro-batches: padded (use_remove_padding=false) "
                                 "micro-batches take use_dynamic_bsz=false there")
            groups = padded_budget_micro_batches(
                batch["attention_mask"].sum(1), batching.max_token_len, cp_size=cp, multiple_of=multiple,
                field=batching.field,
            )
        else:
            groups = fixed_micro_batches(len(batch), batching.micro_batch_size)
        prompt_len = batch["prompts"].shape[1]
        common = 0
        if vpp:
            # Megatron's interleaved (VPP) schedule mixes up tensor shapes of different micro-batches:
            # give every micro-batch of the step the same shape.
            if not batching.pack and len(batch) % batching.micro_batch_size:
                raise ValueError(
                    "virtual pipeline stages need equal micro-batches: use a micro-batch size dividing the "
                    f"{len(batch)} rows per rank"
                )
            common = (max(sum(segments[i] for i in g) for g in groups) if batching.pack
                      else int(batch["attention_mask"].sum(1).max()))
        return groups, [
            build_micro_batch(
                batch.index(rows), prompt_len, pack=batching.pack, common=common, cp_size=cp,
                cp_rank=self.layout.cp_rank, multiple_of=multiple, replay=self.routing is not None,
            )
            for rows in groups
        ]

    @property
    def _length_multiple(self) -> int:
        """Extra multiple every row length needs: the TP size with sequence parallelism (it splits the sequence)."""
        return self.layout.tensor_model_parallel_size if self.tcfg.sequence_parallel else 1

    def _agreed_count(self, segments: list[int], batching: MicroBatching) -> int:
        """Micro-batches this step: the most any DP replica needs (a multiple of PP with VPP)."""
        count = packed_budget_count(segments, batching.max_token_len, field=batching.field)
        if self.layout.data_parallel_size > 1:
            box = comm.to_host([count], torch.long)
            count = int(comm.all_reduce_host(box, op=dist.ReduceOp.MAX, group=self.layout.dp_group())[0])
        pp = self.layout.pipeline_model_parallel_size
        if len(self.chunks) > 1 and count % pp:
            count += pp - count % pp  # Megatron's interleaved schedule runs micro-batches in groups of PP
        if count > len(segments):
            raise ValueError(
                f"{count} micro-batches (the most a data-parallel replica needs) for {len(segments)} rows on this "
                f"rank: raise {batching.field} or give every replica as many rows"
            )
        return count

    # ------------------------------------------------------------------ schedule
    def _run(
        self, mbs: list[MicroBatch], head_fn: HeadFn, loss_fn: LossFn | None, forward_only: bool
    ) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
            # The one host-to-device copy of this micro-batch.
            mb = to_device(next(data_iterator), self.device, offsets_on_device=self.offsets_on_device)
            if self.routing is not None:
                self.routing.set_micro_batch(model, mb.routing)
            # attention_mask=None: attention is causal (within each packed row), right for rows that start at 0.
            out = model(
                input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None,
                packed_seq_params=mb.packed_seq_params,
            )
            return out, partial(self._post, mb, head_fn, loss_fn, forward_only, model)

        pp = self.layout.pipeline_model_parallel_size
        if len(self.chunks) > 1 and len(mbs) % pp:
            # Megatron's interleaved schedule runs micro-batches in groups of PP.
            raise ValueError(
                f"virtual pipeline stages need a multiple of pipeline_model_parallel_size={pp} micro-batches "
                f"per step on each rank, got {len(mbs)}: change the micro-batch size or the mini-batch size"
            )
        iters = [iter(mbs) for _ in self.chunks]
        # The schedule of this model's layout, which need not be parallel_state's (a teacher's own split).
        fb = get_forward_backward_func(pp_size=pp, vp_size=self.layout.virtual_pipeline_model_parallel_size)
        own = {"pg_collection": self.layout.process_groups()} if isinstance(self.layout, OwnLayout) else {}
        return fb(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(mbs),
            seq_length=max(mb.packed.padded_len for mb in mbs),
            micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
            forward_only=forward_only,
            **own,
        )

    def _post(
        self, mb: MicroBatch, head_fn: HeadFn, loss_fn: LossFn | None, forward_only: bool, model: Any,
        output: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Last-stage loss function given to Megatron (see :func:`.micro_batch.post_process`); with deferred logits the
        head gets the hidden states and the output weight (:class:`HiddenStates`)."""
        if self.logits_chunk_tokens:
            from mcore_agentic.models.bridge import unwrap_model

            output = HiddenStates(output, output_weight(unwrap_model(model)), self.logits_chunk_tokens)
        cp = self.layout.context_parallel_size
        return post_process(
            mb, head_fn, loss_fn, forward_only, output, cp_size=cp, cp_group=self.layout.cp_group() if cp > 1 else None
        )

    def _pp_last_broadcast_obj(self, obj: Any) -> Any:
        if self.layout.pipeline_model_parallel_size == 1:
            return obj
        return comm.broadcast_object(
            obj, group=self.layout.pp_group(), group_src=self.layout.pipeline_model_parallel_size - 1
        )

    def forward_only(self, batch: Batch, head_fn: HeadFn, batching: MicroBatching) -> dict[str, torch.Tensor]:
        """Per-response-token outputs ``{name: [b, R, ...]}`` of ``head_fn`` for this replica's rows ``batch``, on
        every rank of it."""
        groups, mbs = self.micro_batches(batch, batching)
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            outputs = self._run(mbs, head_fn, None, forward_only=True)
        merged = merge_outputs(outputs) if self.layout.is_pipeline_last_stage else None  # micro-batch order
        # Each output's trailing shape and dtype (a teacher's top-k: [k] and int64), as the last stage has them.
        shapes = self._pp_last_broadcast_obj(
            {k: (tuple(v.shape[1:]), v.dtype) for k, v in merged.items()} if merged is not None else None
        )
        rows = sum(len(g) for g in groups)
        result: dict[str, torch.Tensor] = {}
        for k, (tail, dtype) in sorted(shapes.items()):
            t = merged[k] if merged is not None else comm.device_zeros(rows, *tail, dtype=dtype)
            if self.layout.pipeline_model_parallel_size > 1:  # a payload: the last stage's device tensor
                comm.broadcast_device(
                    t, group=self.layout.pp_group(), group_src=self.layout.pipeline_model_parallel_size - 1
                )
            # once per pass to the host, where the experience path works; row order from the host's indices
            result[k] = rows_in_order(t.cpu(), groups, len(batch))
        return result

    def forward_backward(
        self, batch: Batch, head_fn: HeadFn, loss_fn: LossFn, batching: MicroBatching
    ) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over this replica's rows ``batch``.

        Returns the metric shares summed over micro-batches and DP ranks (identical on every rank).
        Call :meth:`zero_grad` before and :meth:`step` after.
        """
        if not self.trainable:
            raise RuntimeError("this model has no optimizer (built with optim=None): it cannot be trained")
        from megatron.core.distributed import finalize_model_grads

        _, mbs = self.micro_batches(batch, batching)
        for chunk in self.chunks:
            chunk.train()
        with self._router_losses_per_global_token(mbs):
            outputs = self._run(mbs, head_fn, loss_fn, forward_only=False)
        # DP x CP gradient sum (no scaling: calculate_per_token_loss), tied-embedding and TP-norm fix-ups.
        finalize_model_grads(self.chunks, num_tokens=None)
        sums = sum_metrics(outputs) if self.layout.is_pipeline_last_stage else None
        sums = self._pp_last_broadcast_obj(sums)
        keys = sorted(sums)
        if self.layout.data_parallel_size > 1 and keys:
            vec = comm.all_reduce_host(comm.to_host([sums[k] for k in keys], torch.float64), group=self.layout.dp_group())
            sums = dict(zip(keys, vec.tolist()))
        return sums

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict[str, float]:
        """Clip, optimizer step (params all-gathered by the distributed optimizer), LR scheduler step."""
        lr = float(self.optimizer.param_groups[0]["lr"])  # the LR this step uses (warmup starts at 0)
        ok, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:
            grad_norm = float("nan")  # clip_grad == 0: Megatron skips the norm
        self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm), "lr": lr, "update_ok": float(ok)}

    # ------------------------------------------------------------------ export / offload
    @contextlib.contextmanager
    def _router_losses_per_global_token(self, mbs: list[MicroBatch]) -> Any:
        """MoE router losses as means over the mini-batch's tokens. Under ``calculate_per_token_loss`` Megatron
        adds each micro-batch's aux/z loss times its token count and expects ``finalize_model_grads`` to divide
        every gradient by the total; this model normalises in ``loss_fn`` instead (no division there), so the
        coefficients are divided by the total tokens of the mini-batch over DP x CP for the duration of the pass."""
        aux, z = self.moe_losses
        if aux == 0 and z == 0:
            yield
            return
        total = comm.to_host([float(sum(mb.tokens.numel() for mb in mbs))], torch.float64)
        comm.all_reduce_host(total, group=self.layout.dp_group(with_context_parallel=True))
        n = max(float(total[0]), 1.0)
        before = (self.tcfg.moe_aux_loss_coeff, self.tcfg.moe_z_loss_coeff)
        self.tcfg.moe_aux_loss_coeff = aux / n
        self.tcfg.moe_z_loss_coeff = z / n if z > 0 else None
        try:
            yield
        finally:
            self.tcfg.moe_aux_loss_coeff, self.tcfg.moe_z_loss_coeff = before

    def moe_metrics(self) -> dict[str, float]:
        """Expert load over the passes since the last call (``moe/*``, see :mod:`.moe_load`); {} for a dense
        model. Collective over DP x CP and PP."""
        if not self.is_moe:
            return {}
        return self.router_load.pop(self.layout.dp_group(with_context_parallel=True), self.layout.pp_group())

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Full HF tensors of the model (collective: every rank must call)."""
        return dict(self.bridge.export_hf_weights(self.chunks))

    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Move the named state off the device (see :mod:`offload`); returns bytes moved."""
        moved = 0
        if params and not self.offloader.is_offloaded("params"):
            moved += self.offloader.offload("params", model_param_tensors(self.chunks))
        if grads and self.trainable and not self.offloader.is_offloaded("grads"):
            moved += self.offloader.offload("grads", model_grad_tensors(self.chunks))
        if optimizer and self.optimizer is not None and not self.offloader.is_offloaded("optimizer"):
            # fp32 main params may be views of the model's parameters: those move only with ``params``.
            keep = [] if params else model_param_tensors(self.chunks)
            moved += self.offloader.offload("optimizer", optimizer_tensors(self.optimizer), exclude=keep)
        return moved

    def reload(self) -> int:
        """Bring back everything :meth:`offload` moved; returns bytes moved."""
        moved = 0
        for group in ("params", "grads", "optimizer"):
            if self.offloader.is_offloaded(group):
                moved += self.offloader.reload(group)
        return moved


__all__: Sequence[str] = ["HeadFn", "LossFn", "MegatronModel", "MicroBatch", "MicroBatching"]
