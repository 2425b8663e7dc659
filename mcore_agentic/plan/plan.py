"""A run's memory per rank in each phase of a step, and an estimate of the step's time, before anything is built.

The resident state of every Megatron model (actor, critic, reference, teacher) comes from the census
(:mod:`.census`: megatron-core's own build on the meta device); activations from :mod:`.activations`; the rollout
engine's share from its own setting (vLLM and SGLang hold ``rollout.gpu_memory_utilization`` of the GPU while they
roll out, and release it while the trainer trains). Offload keys move a model's state to the host between the
phases that use it, so a phase counts only what is resident then.

Phases (one step, in order): ``rollout`` (the engine at its fraction; the trainer's resident state),
``weight_sync`` (the engine's weights, the actor's parameters, the export buckets), ``log_probs`` (the largest of
the actor's, reference's, teacher's and critic's forward passes), ``critic_update``, ``actor_update``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mcore_agentic.models.spec import logits_chunk_tokens
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.parallel.own_layout import own_tp_split
from mcore_agentic.plan.activations import Dims, Recompute, Split, forward_peak_bytes, update_peak_bytes
from mcore_agentic.plan.census import DTYPE_BYTES, RankState, census_request, run_census, stage_ranks
from mcore_agentic.plan.devices import GIB, Device
from mcore_agentic.utils.errors import ConfigError

CUDA_CONTEXT_BYTES = int(0.75 * GIB)
"""The CUDA context, NCCL's buffers and the allocator's fragmentation on each rank: an assumption (stated in
docs/planner.md), not a measurement."""
MFU = 0.35
"""Model FLOPs utilisation assumed for the training passes and prefill (``--mfu``)."""
HBM_EFFICIENCY = 0.7
"""Fraction of the HBM bandwidth a decode step reaches."""
GPUS_PER_NODE = 8
"""GPUs one NVLink domain joins: TP and EP groups larger than this cross nodes."""
HOST_LINK_GB_S = 25.0
"""Host <-> GPU copies of offloaded state, GB/s each way (pinned memory over PCIe Gen5 x16 reaches about half its
64 GB/s peak in practice; an assumption)."""
HOST_ADAM_PARAMS_PER_S = 1.0e9
"""Parameters one rank's host Adam (torch's fused AdamW, ``optim.optimizer_cpu_offload``) steps per second: memory
bound at ~28 bytes per parameter; one core of the 2-core CI machine steps 0.72e9/s (docs/planner.md), and a GPU
node gives each rank several cores but shares the sockets' bandwidth among its GPUs (an assumption)."""
ENGINE_ACTIVATION_BYTES = 2 * GIB
"""What vLLM's and SGLang's profiling run reserves for the engine's own activations inside its share (an
assumption: it depends on their batched-token limit); the rest of the share after the weights is KV cache."""

LINK_GB_S = 2.5
"""Separate placement's weight links: gloo through host memory over the job's network (one TCP stream; an
assumption, not measured on GPUs yet), per engine."""


def _host_fraction(group: Any) -> float:
    """The share of a trained model's optimizer (fp32 masters and Adam moments) kept on the host."""
    return group.optim.optimizer_offload_fraction if group.optim.optimizer_cpu_offload else 0.0


def kv_bytes_per_token(hf_config: Any, dtype_bytes: int, rollout_tp: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU of an engine: keys and values of every layer, the KV heads split
    over the engine's TP (replicated when TP exceeds them), as vLLM's and SGLang's paged caches store them."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = max(c.num_key_value_heads // rollout_tp, 1)
    return 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes


@dataclass
class EngineShare:
    """The rollout engine's share of each GPU."""

    share_bytes: int
    weight_bytes: int
    kv_bytes: int
    kv_tokens: int
    """Tokens the KV cache holds on one engine."""
    concurrent_sequences: int
    """Sequences of the longest length (prompt + response) the KV cache holds at once."""
    problem: str | None = None
    """Why the share cannot roll out (no room for one sequence), else None."""


@dataclass
class Phase:
    name: str
    bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    """The rank this phase is counted on: the first rank of its worst pipeline stage."""


@dataclass
class Plan:
    device: str
    world_size: int
    layout: str
    capacity_bytes: int
    headroom: float
    phases: list[Phase]
    step_seconds: dict[str, float]
    notes: list[str]
    engine: EngineShare | None = None
    generation_terms: list[str] = field(default_factory=list)
    """Separate placement: the terms the rollout ranks spend while the trainer trains (the step is the slower of
    the two sides); empty when colocated (every term adds up)."""

    @property
    def total_seconds(self) -> float:
        """The step: every term's sum when colocated; the slower side plus nothing else when separate (the weight
        transfer is the trainer's: it counts on its side)."""
        if not self.generation_terms:
            return sum(self.step_seconds.values())
        generation = sum(v for k, v in self.step_seconds.items() if k in self.generation_terms)
        training = sum(v for k, v in self.step_seconds.items() if k not in self.generation_terms)
        return max(generation, training)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def fits(self) -> bool:
        engine_ok = self.engine is None or self.engine.concurrent_sequences > 0
        return engine_ok and self.peak.bytes <= self.capacity_bytes * (1 - self.headroom)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(peak_phase=self.peak.name, peak_bytes=self.peak.bytes, fits=self.fits,
                   total_seconds=self.total_seconds)
        return out


def dims_of(hf_config: Any, padded_vocab: int) -> Dims:
    """The shapes :mod:`.activations` needs, read from the HF config as the bridges read it."""
    c = hf_config
    experts = int(getattr(c, "num_experts", 0) or 0)
    sparse_step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    dense_only = set(getattr(c, "mlp_only_layers", []) or [])
    moe_layers = sum(1 for i in range(c.num_hidden_layers)
                     if experts and i not in dense_only and (i + 1) % sparse_step == 0)
    return Dims(
        hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        ffn=c.intermediate_size, layers=c.num_hidden_layers, vocab=padded_vocab, experts=experts,
        top_k=int(getattr(c, "num_experts_per_tok", 0) or 0),
        expert_ffn=int(getattr(c, "moe_intermediate_size", 0) or 0), moe_layers=moe_layers,
        qk_norm=c.model_type in ("qwen3", "qwen3_moe"),
    )


def recomputed_fraction(dims: Dims, recompute: Recompute, layers_per_rank: int, chunks: int) -> float:
    """The share of a forward pass's matmul FLOPs that ``recompute`` runs again in the backward pass: every layer
    (``full uniform``), the first ``recompute_num_layers`` of each chunk (``block``), the dense MLPs' or the experts'
    share of a layer (``selective`` ``mlp``/``moe``); norms and the attention kernel count no matmul FLOPs here (as
    the step time's attention is not counted either)."""
    if recompute.granularity == "full":
        if recompute.method == "block":
            return min(recompute.num_layers * chunks, layers_per_rank) / max(layers_per_rank, 1)
        return 1.0
    if recompute.granularity != "selective":
        return 0.0
    attention = dims.hidden * (2 * dims.heads + 2 * dims.kv_heads) * dims.head_dim
    mlp = 3 * dims.hidden * dims.ffn
    experts = dims.top_k * 3 * dims.hidden * dims.expert_ffn
    moe_share = dims.moe_layers / max(dims.layers, 1)
    per_layer = attention + (1 - moe_share) * mlp + moe_share * experts
    share = 0.0
    if recompute.selects("mlp"):
        share += (1 - moe_share) * mlp
    if recompute.selects("moe"):
        share += moe_share * experts
    return share / per_layer


def _micro_rows(micro_rows: int, dynamic: bool, token_budget: int, max_len: int) -> list[int]:
    """The largest micro-batch's rows: a token budget's worth of the longest rows, or ``micro_rows`` of them."""
    if dynamic:
        rows = max(token_budget // max_len, 1)
        return [max_len] * rows if rows * max_len <= token_budget else [token_budget]
    return [max_len] * micro_rows


def census_requests(cfg: Any, par: Any, hf_config: Any, teacher_hf_config: Any, world_size: int) -> list[dict]:
    """The census questions of a plan: the actor's (trainable) layout, and the teacher's under the same layout or
    its own tensor-parallel split (``teacher.tensor_model_parallel_size``: one stage, every rank alike)."""
    common = dict(world_size=world_size, ranks=stage_ranks(world_size, par.pipeline_model_parallel_size),
                  dtype=cfg.model.dtype, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    requests = [census_request(hf_config, par, use_distributed_optimizer=cfg.actor.use_distributed_optimizer,
                               **common)]
    if teacher_hf_config is not None and cfg.teacher.tensor_model_parallel_size is not None:
        requests.append(census_request(teacher_hf_config, own_tp_split(par, cfg.teacher.tensor_model_parallel_size),
                                       **{**common, "ranks": [0]}))
    elif teacher_hf_config is not None:
        requests.append(census_request(teacher_hf_config, par, **common))
    # The whole model on one rank: its parameter count, for the engine's weights and the FLOPs.
    requests.append(census_request(hf_config, ParallelConfig(), world_size=1, ranks=[0], dtype=cfg.model.dtype,
                                   make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by))
    return requests


@dataclass(frozen=True)
class _Sizing:
    """What every phase of the plan reads: the layout, the census's answers and the model's dimensions."""

    par: Any
    tp: int
    pp: int
    cp: int
    vpp: int
    size: int
    ranks: list[int]
    needs_ref: bool
    needs_critic: bool
    actor: list[RankState]
    teacher: list[RankState] | None
    dims: Dims
    split: Split
    max_len: int
    update_rows: list[int]
    forward_rows: list[int]
    layers_per_rank: int
    actor_recompute: Recompute
    critic_recompute: Recompute
    total_params: int
    active_params: float
    rollout_tp: int


def _sizing(cfg: Any, hf_config: Any, world_size: int, teacher_hf_config: Any, census: Any) -> _Sizing:
    """The layout of ``cfg``, the census's answers (one call) and the dimensions every phase reads."""
    par = cfg.actor.parallel
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    vpp = par.virtual_pipeline_model_parallel_size or 1
    dtype = cfg.model.dtype
    size = DTYPE_BYTES[dtype]
    ranks = stage_ranks(world_size, pp)
    multiple = cfg.model.make_vocab_size_divisible_by
    needs_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.policy_loss.use_kl_loss
    needs_critic = bool(cfg.algorithm.needs_critic)
    answers = census(census_requests(cfg, par, hf_config, teacher_hf_config, world_size))
    actor: list[RankState] = answers[0]
    teacher: list[RankState] | None = answers[1] if teacher_hf_config is not None else None
    padded_vocab = -(-hf_config.vocab_size // (multiple * tp)) * multiple * tp
    dims = dims_of(hf_config, padded_vocab)
    split = Split(tp=tp, cp=cp, sequence_parallel=par.sequence_parallel, fused_attention=True, dtype_bytes=size,
                  logits_chunk_tokens=logits_chunk_tokens(cfg.model.logits_chunk_mb, padded_vocab // tp))
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    a = cfg.actor
    update_rows = _micro_rows(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, max_len)
    r = cfg.ref
    forward_rows = _micro_rows(r.log_prob_micro_batch_size_per_gpu, r.use_dynamic_bsz,
                               r.log_prob_max_token_len_per_gpu, max_len)
    layers_per_rank = math.ceil(dims.layers / pp)
    actor_recompute = Recompute.of(a.recompute)
    critic_recompute = Recompute.of(cfg.critic.recompute)
    whole = answers[-1][0]
    total_params = whole.params
    # A token passes through top_k of each MoE layer's experts: the active parameters a decode step reads and a
    # token's FLOPs count.
    active_params = total_params - whole.expert_params * (1 - dims.top_k / dims.experts if dims.experts else 0)
    rollout_tp = cfg.rollout.tensor_model_parallel_size
    return _Sizing(par=par, tp=tp, pp=pp, cp=cp, vpp=vpp, size=size, ranks=ranks, needs_ref=needs_ref,
                   needs_critic=needs_critic, actor=actor, teacher=teacher, dims=dims, split=split, max_len=max_len,
                   update_rows=update_rows, forward_rows=forward_rows, layers_per_rank=layers_per_rank,
                   actor_recompute=actor_recompute, critic_recompute=critic_recompute, total_params=total_params,
                   active_params=active_params, rollout_tp=rollout_tp)


def _engine_share(cfg: Any, hf_config: Any, device: Device, s: _Sizing, notes: list[str]) -> EngineShare:
    """The rollout engine's share of the GPU: its weights and the KV cache left (a problem in ``notes`` if none)."""
    size, rollout_tp, total_params, max_len = s.size, s.rollout_tp, s.total_params, s.max_len
    engine_bytes = int(cfg.rollout.gpu_memory_utilization * device.memory_gib * GIB)
    engine_weight_bytes = int(total_params * size / rollout_tp)
    kv_bytes = engine_bytes - engine_weight_bytes - ENGINE_ACTIVATION_BYTES
    kv_tokens = max(kv_bytes, 0) // kv_bytes_per_token(hf_config, size, rollout_tp)
    engine = EngineShare(share_bytes=engine_bytes, weight_bytes=engine_weight_bytes, kv_bytes=max(kv_bytes, 0),
                         kv_tokens=int(kv_tokens), concurrent_sequences=int(kv_tokens // max_len))
    if engine.concurrent_sequences == 0:
        engine.problem = (f"the engine's share ({engine_bytes / GIB:.1f} GiB: rollout.gpu_memory_utilization) leaves "
                          f"no KV cache for one {max_len}-token sequence after its weights "
                          f"({engine_weight_bytes / GIB:.1f} GiB) and activations: raise it or "
                          "rollout.tensor_model_parallel_size")
        notes.append(engine.problem)

    return engine


def _memory_phases(cfg: Any, s: _Sizing, engine: EngineShare) -> tuple[list[Phase], int]:
    """Each phase at its worst pipeline stage, and the bytes that leave the GPU and come back each step."""
    a, r = cfg.actor, cfg.ref
    pp, vpp, ranks, needs_ref, needs_critic, teacher = s.pp, s.vpp, s.ranks, s.needs_ref, s.needs_critic, s.teacher
    dims, split, update_rows, forward_rows, layers_per_rank = (s.dims, s.split, s.update_rows, s.forward_rows,
                                                               s.layers_per_rank)
    actor_recompute, critic_recompute = s.actor_recompute, s.critic_recompute
    engine_bytes, engine_weight_bytes = engine.share_bytes, engine.weight_bytes
    bucket = int(cfg.sharding.bucket_size_mb * 2**20)
    phases_by_stage: list[list[Phase]] = []
    offloaded = 0  # bytes that leave the GPU and come back each step, on the worst stage
    for stage, st in enumerate(s.actor):
        last = stage == pp - 1
        # optim.optimizer_cpu_offload: that fraction of the masters and moments lives on the host for good.
        on_device = 1 - _host_fraction(a)
        state = {"actor params": st.param_bytes, "actor grads": st.grad_bytes,
                 "actor master params": int(st.main_param_bytes * on_device),
                 "actor Adam": int(st.optimizer_bytes * on_device)}
        resident_actor = ((0 if a.param_offload else st.param_bytes) + (0 if a.grad_offload else st.grad_bytes)
                          + (0 if a.optimizer_offload else state["actor master params"] + state["actor Adam"]))
        ref_bytes = st.frozen_param_bytes if needs_ref else 0
        resident_ref = 0 if r.param_offload else ref_bytes
        c = cfg.critic
        critic_optimizer = int((st.main_param_bytes + st.optimizer_bytes) * (1 - _host_fraction(c)))
        critic_bytes = (st.param_bytes + st.grad_bytes + critic_optimizer) if needs_critic else 0
        resident_critic = 0
        if needs_critic:
            resident_critic = ((0 if c.param_offload else st.param_bytes) + (0 if c.grad_offload else st.grad_bytes)
                               + (0 if c.optimizer_offload else critic_optimizer))
        teacher_bytes = teacher[min(stage, len(teacher) - 1)].frozen_param_bytes if teacher is not None else 0
        resident_teacher = 0 if (teacher is None or cfg.teacher.param_offload) else teacher_bytes
        resident = resident_actor + resident_ref + resident_critic + resident_teacher
        everything = (st.param_bytes + st.grad_bytes + state["actor master params"] + state["actor Adam"] + ref_bytes
                      + critic_bytes + teacher_bytes)
        offloaded = max(offloaded, everything - resident)
        base = {"CUDA context and fragmentation": CUDA_CONTEXT_BYTES}
        # Separate placement: the engines are on the rollout ranks' GPUs (their phase is added by make_plan).
        here = 0 if cfg.rollout.separate else 1
        rollout = Phase("rollout", 0, {**base, "engine (gpu_memory_utilization)": engine_bytes * here,
                                       "trainer state left on the GPU": resident})
        sync = Phase("weight_sync", 0, {**base, "engine weights": engine_weight_bytes * here,
                                        "trainer state left on the GPU": resident - (0 if a.param_offload else st.param_bytes),
                                        "actor params": st.param_bytes, "export buckets (x2)": 2 * bucket})
        # 1F1B: stage s holds up to PP - s micro-batches' activations; the interleaved warm-up keeps more.
        in_flight = pp * vpp - stage if vpp > 1 else pp - stage
        fwd = forward_peak_bytes(dims, split, forward_rows, last_stage=last)
        log_probs = Phase("log_probs", 0, {**base, "trainer state left on the GPU": resident,
                                           "the scored model's params (when offloaded)": max(
                                               st.param_bytes if a.param_offload else 0,
                                               ref_bytes if r.param_offload else 0,
                                               teacher_bytes if teacher is not None and cfg.teacher.param_offload else 0),
                                           "forward activations and logits": fwd})
        upd_act = update_peak_bytes(dims, split, update_rows, layers=layers_per_rank, last_stage=last,
                                    in_flight=in_flight, recompute=actor_recompute, chunks=vpp)
        critic_act = update_peak_bytes(dims, split, update_rows, layers=layers_per_rank, last_stage=last,
                                       in_flight=in_flight, recompute=critic_recompute, chunks=vpp)
        actor_update = Phase("actor_update", 0, {**base, **state,
                                                 "others left on the GPU": resident_ref + resident_critic + resident_teacher,
                                                 "update activations and logits grad": upd_act})
        phases = [rollout, sync, log_probs]
        if needs_critic:
            phases.append(Phase("critic_update", 0, {**base, "critic state": critic_bytes,
                                                     "others left on the GPU": resident_actor + resident_ref + resident_teacher,
                                                     "update activations": critic_act}))
        phases.append(actor_update)
        for ph in phases:
            ph.bytes = sum(ph.parts.values())
            ph.rank = ranks[stage]
        phases_by_stage.append(phases)
    # Each phase at its worst stage.
    worst = [max((stage_phases[i] for stage_phases in phases_by_stage), key=lambda p: p.bytes)
             for i in range(len(phases_by_stage[0]))]
    return worst, offloaded


def _step_seconds(cfg: Any, device: Device, world_size: int, s: _Sizing, engine: EngineShare, offloaded: int, *,
                  mfu: float, mean_length: int | None) -> dict[str, float]:
    """The step's time by part: rollout, weight sync, offload, training passes, recomputation, communication,
    the host optimizer and the pipeline bubble."""
    a, par = cfg.actor, s.par
    tp, pp, cp, vpp, size, max_len, rollout_tp = s.tp, s.pp, s.cp, s.vpp, s.size, s.max_len, s.rollout_tp
    needs_ref, needs_critic, teacher, dims = s.needs_ref, s.needs_critic, s.teacher, s.dims
    total_params, active_params, layers_per_rank = s.total_params, s.active_params, s.layers_per_rank
    actor_recompute, critic_recompute, update_rows, actor = (s.actor_recompute, s.critic_recompute, s.update_rows,
                                                             s.actor)
    engine_weight_bytes = engine.weight_bytes
    prompts = cfg.data.train_batch_size
    sequences = prompts * cfg.rollout.n
    prompt_tokens = sequences * cfg.data.max_prompt_length
    response_tokens = cfg.data.max_response_length
    train_tokens = sequences * min(mean_length or max_len, max_len)
    flops = device.bf16_tflops * 1e12 * mfu
    rollout_ranks = cfg.rollout.rollout_ranks if cfg.rollout.separate else world_size
    engines = max(rollout_ranks // rollout_tp, 1)
    decode_step = engine_weight_bytes * (active_params / total_params) / (device.hbm_tb_s * 1e12 * HBM_EFFICIENCY)
    waves = math.ceil(sequences / engines / max(engine.concurrent_sequences, 1))  # batches the KV cache allows
    seconds = {
        f"rollout decode (bandwidth bound, {waves} wave(s) of concurrent sequences)": waves * response_tokens * decode_step,
        "rollout prefill": 2 * active_params * prompt_tokens / engines / (flops * rollout_tp),
        "weight sync": total_params * size / (device.hbm_tb_s * 1e12 * HBM_EFFICIENCY) / max(tp * pp, 1),
    }
    if cfg.rollout.separate:  # the trainer's rank 0 sends every engine the whole model over its link, in turn
        seconds["weight transfer to the rollout ranks (gloo through the host)"] = (
            total_params * size * engines / (LINK_GB_S * 1e9))
    if offloaded:
        seconds["offload transfers (host <-> GPU)"] = 2 * offloaded / (HOST_LINK_GB_S * 1e9)
    forward_passes = 1 + needs_ref + (teacher is not None) + needs_critic
    train_flops = 2 * active_params * train_tokens * forward_passes + 6 * active_params * train_tokens * (1 + needs_critic)
    seconds["training passes (FLOPs / MFU)"] = train_flops / world_size / flops
    # Recomputation runs the recomputed part of the forward pass again in each update's backward pass.
    recompute_flops = 2 * active_params * train_tokens * (
        recomputed_fraction(dims, actor_recompute, layers_per_rank, vpp)
        + needs_critic * recomputed_fraction(dims, critic_recompute, layers_per_rank, vpp))
    if recompute_flops:
        seconds["activation recomputation (FLOPs / MFU)"] = recompute_flops / world_size / flops
    dp = max(world_size // (tp * pp * cp), 1)
    if tp > 1:  # per layer: 2 all-reduces (or SP's all-gather + reduce-scatter) forward, 2 backward, ring volume
        per_layer = 4 * (train_tokens / dp / cp) * dims.hidden * size * 2 * (tp - 1) / tp
        passes = 1 + needs_critic + forward_passes / 3  # updates, plus forward-only passes at a third of the traffic
        seconds["TP all-reduces"] = per_layer * dims.layers / pp / (device.intra_node_gb_s * 1e9) * passes
    if cp > 1:  # every layer all-gathers the row's keys and values (and reduce-scatters their gradients) over CP
        kv_dim = max(dims.kv_heads // tp, 1) * dims.head_dim
        volume = 2 * 2 * (train_tokens / dp / cp) * kv_dim * size * (cp - 1)
        link = device.intra_node_gb_s if tp * cp <= GPUS_PER_NODE else device.inter_node_gb_s
        seconds["CP all-gathers"] = volume * dims.layers / pp / (link * 1e9) * (1 + needs_critic + forward_passes / 2)
    ep = par.expert_model_parallel_size
    if ep > 1 and dims.moe_layers:  # dispatch and combine of every routed copy, forward and backward
        volume = 4 * (train_tokens / dp / cp) * dims.top_k * dims.hidden * size * (ep - 1) / ep
        link = device.intra_node_gb_s if ep * tp <= GPUS_PER_NODE else device.inter_node_gb_s
        passes = 1 + forward_passes / 3
        seconds["EP all-to-all"] = volume * dims.moe_layers / pp / (link * 1e9) * passes
    # Micro-batches per optimizer step on one rank: each mini-batch fills and drains the pipeline once.
    mini_batches = max(cfg.data.train_batch_size // max(cfg.actor.ppo_mini_batch_size, 1), 1)
    micro = max(sequences // dp // max(len(update_rows), 1) // mini_batches, 1)
    # A host optimizer takes each step's gradients down and its updated params up (fp32, 4 bytes each way) and
    # steps its share of the shard on the CPU, once per mini-batch.
    host_params = max(st.main_param_bytes // 4 for st in actor) * (
        _host_fraction(a) + needs_critic * _host_fraction(cfg.critic))
    if host_params:
        seconds["host optimizer (grads down, params up, CPU Adam)"] = mini_batches * a.ppo_epochs * host_params * (
            8 / (HOST_LINK_GB_S * 1e9) + 1 / HOST_ADAM_PARAMS_PER_S)
    if pp > 1:
        seconds["pipeline bubble"] = seconds["training passes (FLOPs / MFU)"] * (pp - 1) / (micro * vpp)
    return seconds


def make_plan(cfg: Any, hf_config: Any, device: Device, world_size: int, *, teacher_hf_config: Any = None,
              headroom: float = 0.05, mfu: float = MFU, mean_length: int | None = None,
              census: Any = run_census) -> Plan:
    """The plan of ``cfg`` (an ``RLConfig``) on ``world_size`` GPUs of ``device``. ``mean_length``: an average
    sequence's tokens (prompt + response) for the step time's training passes (default: the longest); memory is
    always planned for the longest."""
    job_world = world_size
    if cfg.rollout.separate:  # the trainer's ranks train; the plan's memory phases are theirs, plus a rollout rank's
        world_size = job_world - cfg.rollout.rollout_ranks
        if world_size < 1:
            raise ConfigError("rollout.rollout_ranks", f"={cfg.rollout.rollout_ranks} leaves no trainer rank of "
                                                       f"{job_world} GPUs")
    s = _sizing(cfg, hf_config, world_size, teacher_hf_config, census)
    notes: list[str] = []
    engine = _engine_share(cfg, hf_config, device, s, notes)
    worst, offloaded = _memory_phases(cfg, s, engine)
    generation: list[str] = []
    if cfg.rollout.separate:
        rollout_rank = Phase("rollout_rank", 0, {"CUDA context and fragmentation": CUDA_CONTEXT_BYTES,
                                                 "engine (gpu_memory_utilization)": engine.share_bytes},
                             rank=world_size)
        rollout_rank.bytes = sum(rollout_rank.parts.values())
        worst.append(rollout_rank)
    if not cfg.rollout.engine.sized_by_gpu_memory_utilization:  # the engine table's answer
        notes.append(f"rollout.name={cfg.rollout.name}: the {cfg.rollout.engine.description} engine is not sized by "
                     "gpu_memory_utilization (the plan counts that fraction anyway)")
    seconds = _step_seconds(cfg, device, world_size, s, engine, offloaded, mfu=mfu, mean_length=mean_length)
    tp, pp, cp, vpp, par, rollout_tp = s.tp, s.pp, s.cp, s.vpp, s.par, s.rollout_tp
    layout = (f"TP{tp} PP{pp}" + (f" VPP{vpp}" if vpp > 1 else "") + f" CP{cp} EP{par.expert_model_parallel_size} "
              f"DP{world_size // (tp * pp * cp)}; rollout TP{rollout_tp}")
    if cfg.rollout.separate:
        generation = [k for k in seconds if k.startswith("rollout ")]
        layout += f"; separate: {world_size} train + {cfg.rollout.rollout_ranks} rollout ranks"
    return Plan(device=device.name, world_size=job_world, layout=layout, capacity_bytes=int(device.memory_gib * GIB),
                headroom=headroom, phases=worst, step_seconds=seconds, notes=notes, engine=engine,
                generation_terms=generation)
