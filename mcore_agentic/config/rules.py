"""Cross-group rules of a run config, and the batch sizes every stage derives from it.

This module is the one place for the run's divisibility rules: the model-parallel sizes
against the world size (:func:`check_world_size`) and the model's shape
(:func:`check_model_split`), the rollout groups against the world and the node
(:func:`check_rollout_groups`), and the batch sizes below. The launcher runs
:func:`validate` before Megatron's process groups exist; the objects built afterwards
(layout, rollout placement, workers) trust what it accepted.

Batch sizes mean what verl users expect:

* ``data.train_batch_size``: prompts per step; each is sampled ``rollout.n``
  times, so a step trains on ``train_batch_size * n`` sequences;
* ``actor.ppo_mini_batch_size`` (and ``critic.``): **prompts** per optimizer
  step, i.e. ``ppo_mini_batch_size * n`` sequences over all data-parallel ranks;
* ``actor.ppo_micro_batch_size_per_gpu``: sequences per forward/backward on one
  rank (gradient accumulation), unused with ``use_dynamic_bsz`` where
  ``ppo_max_token_len_per_gpu`` bounds the tokens per micro-batch instead.

:func:`validate` checks the rules and returns :class:`BatchSizes`, the
normalised numbers the trainer and workers use; the config itself is never
rewritten. Every violation raises :class:`ConfigError` naming the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_agentic.config.schema import RLConfig
from mcore_agentic.models.config import ModelConfig, uses_transformer_engine
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.rollout.config import engines_on
from mcore_agentic.utils.errors import ConfigError, require
from mcore_agentic.workers.config import ActorConfig, CriticConfig


@dataclass(frozen=True)
class PPOBatchSizes:
    """Normalised update batch sizes of one trained model (actor or critic)."""

    mini_batch_prompts: int
    """Prompts per optimizer step (the config value)."""
    mini_batch_sequences: int
    """Sequences per optimizer step over all DP ranks: prompts x rollout.n."""
    mini_batch_sequences_per_dp: int
    """Sequences per optimizer step on one DP rank."""
    mini_batches_per_epoch: int
    """Optimizer steps per PPO epoch: train_batch_size / ppo_mini_batch_size."""
    micro_batch_size_per_gpu: int | None
    """Sequences per forward/backward on one rank; None with use_dynamic_bsz."""
    grad_accumulation_steps: int | None
    """Micro-batches per mini-batch on one rank; None with use_dynamic_bsz (it varies with lengths)."""
    max_token_len_per_gpu: int | None
    """Token budget per micro-batch with use_dynamic_bsz, else None."""


@dataclass(frozen=True)
class BatchSizes:
    """Everything about batch shapes that follows from the config and the world size."""

    world_size: int
    data_parallel_size: int
    """world_size / (TP * PP * CP) of the training engine."""
    rollout_data_parallel_size: int
    """world_size / rollout.tensor_model_parallel_size: independent rollout engines."""
    prompts_per_step: int
    sequences_per_step: int
    """prompts_per_step x rollout.n."""
    sequences_per_step_per_dp: int
    actor: PPOBatchSizes
    critic: PPOBatchSizes | None
    """None when the advantage estimator needs no critic."""


def _ppo_sizes(
    group: str,
    worker: ActorConfig | CriticConfig,
    cfg: RLConfig,
    dp: int,
) -> PPOBatchSizes:
    n = cfg.rollout.n
    train = cfg.data.train_batch_size
    mini = worker.ppo_mini_batch_size
    require(
        mini <= train,
        f"{group}.ppo_mini_batch_size",
        f"={mini} prompts is larger than data.train_batch_size={train}: lower it to at most {train}",
    )
    require(
        train % mini == 0,
        f"{group}.ppo_mini_batch_size",
        f"data.train_batch_size={train} is not a multiple of {group}.ppo_mini_batch_size={mini} (both count "
        f"prompts): use a divisor of {train}, e.g. {_divisors_near(train, mini)}",
    )
    sequences = mini * n
    require(
        sequences % dp == 0,
        f"{group}.ppo_mini_batch_size",
        f"{group}.ppo_mini_batch_size * rollout.n = {mini} * {n} = {sequences} sequences do not split evenly over "
        f"{dp} data-parallel ranks: make it a multiple of {dp}",
    )
    per_dp = sequences // dp
    micro = accumulation = max_tokens = None
    if worker.use_dynamic_bsz:
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        require(
            worker.ppo_max_token_len_per_gpu >= longest,
            f"{group}.ppo_max_token_len_per_gpu",
            f"={worker.ppo_max_token_len_per_gpu} cannot hold one full sequence of data.max_prompt_length + "
            f"data.max_response_length = {longest} tokens: raise it to at least {longest}",
        )
        max_tokens = worker.ppo_max_token_len_per_gpu
    else:
        micro = worker.ppo_micro_batch_size_per_gpu
        require(
            micro <= per_dp and per_dp % micro == 0,
            f"{group}.ppo_micro_batch_size_per_gpu",
            f"={micro} does not divide the {per_dp} sequences of a mini-batch on each of {dp} DP ranks "
            f"({group}.ppo_mini_batch_size={mini} x rollout.n={n} / DP={dp}): use a divisor of {per_dp}",
        )
        accumulation = per_dp // micro
    return PPOBatchSizes(
        mini_batch_prompts=mini,
        mini_batch_sequences=sequences,
        mini_batch_sequences_per_dp=per_dp,
        mini_batches_per_epoch=train // mini,
        micro_batch_size_per_gpu=micro,
        grad_accumulation_steps=accumulation,
        max_token_len_per_gpu=max_tokens,
    )


def _divisors_near(n: int, target: int) -> str:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    divs.sort(key=lambda d: (abs(d - target), d))
    return " or ".join(str(d) for d in sorted(divs[:2]))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_world_size(par: ParallelConfig, world_size: int, *, field_prefix: str = "actor") -> None:
    """TP * PP * CP must divide ``world_size`` (the error names the first size at fault)."""
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    if world_size % par.model_parallel_size == 0:
        return
    # the first size whose running product stops dividing the world
    culprit = "tensor_model_parallel_size" if world_size % tp else (
        "pipeline_model_parallel_size" if world_size % (tp * pp) else "context_parallel_size")
    raise ConfigError(
        f"{field_prefix}.{culprit}",
        f"world size {world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {par.model_parallel_size}: "
        f"choose sizes whose product divides {world_size} (divisors: {_divisors(world_size)})",
    )


def check_expert_split(par: ParallelConfig, world_size: int, *, num_experts: int | None = None,
                       field_prefix: str = "actor") -> None:
    """EP must divide the ranks of one TP rank (DP * CP * TP / ETP over the world) and the number of experts
    (``num_experts`` None: not known yet, or a dense model, for which EP must stay 1)."""
    ep = par.expert_model_parallel_size
    if ep == 1:
        return
    field = f"{field_prefix}.expert_model_parallel_size"
    if num_experts is not None and num_experts == 0:
        raise ConfigError(field, f"={ep} but the model has no experts (a dense model): set 1")
    ranks = world_size // par.pipeline_model_parallel_size // par.expert_tensor_parallel_size
    if ranks % ep:
        raise ConfigError(
            field,
            f"={ep} does not divide the {ranks} ranks of a pipeline stage (world {world_size} / PP "
            f"{par.pipeline_model_parallel_size}): choose a divisor of {ranks} ({_divisors(ranks)})",
        )
    if num_experts is not None and num_experts % ep:
        raise ConfigError(field, f"={ep} does not divide the model's {num_experts} experts: choose a divisor of {num_experts}")
    if par.tensor_model_parallel_size > 1 and not par.sequence_parallel:
        raise ConfigError(
            f"{field_prefix}.tensor_model_parallel_size",
            f"={par.tensor_model_parallel_size} with experts needs sequence_parallel (Megatron's MoE layer refuses to "
            "train with TP > 1 without it; sequence parallelism needs TransformerEngine): set TP to 1 on CPU",
        )


def check_model_split(
    par: ParallelConfig, *, num_attention_heads: int, num_query_groups: int | None, num_layers: int,
    field_prefix: str = "actor",
) -> None:
    """TP must divide the attention and KV heads, PP * VPP the layers (``num_query_groups`` None: = heads)."""
    p, tp = field_prefix, par.tensor_model_parallel_size
    vpp = par.virtual_pipeline_model_parallel_size
    require(
        num_attention_heads % tp == 0,
        f"{p}.tensor_model_parallel_size",
        f"={tp} does not divide num_attention_heads={num_attention_heads}: use one of {_divisors(num_attention_heads)}",
    )
    groups = num_attention_heads if num_query_groups is None else num_query_groups
    require(
        groups % tp == 0,
        f"{p}.tensor_model_parallel_size",
        f"={tp} does not divide the model's num_query_groups (KV heads) = {groups}: use one of {_divisors(groups)}",
    )
    stages = par.pipeline_model_parallel_size * (vpp or 1)
    require(
        num_layers % stages == 0,
        f"{p}.{'virtual_pipeline_model_parallel_size' if vpp else 'pipeline_model_parallel_size'}",
        f"num_layers={num_layers} is not divisible by PP*VPP = {par.pipeline_model_parallel_size}*{vpp or 1} = "
        f"{stages}: choose sizes whose product divides {num_layers}",
    )


def check_recompute_split(cfg: RLConfig, par: ParallelConfig, num_layers: int) -> None:
    """The actor's and critic's recomputation units against each model chunk's layers (the critic shares the actor's
    layout)."""
    layers_per_chunk = num_layers // (par.pipeline_model_parallel_size * (par.virtual_pipeline_model_parallel_size or 1))
    cfg.actor.recompute.check_split(layers_per_chunk, "actor")
    if cfg.algorithm.needs_critic:
        cfg.critic.recompute.check_split(layers_per_chunk, "critic")


def check_host_optimizer(cfg: RLConfig) -> None:
    """``<group>.optim.optimizer_cpu_offload`` steps the shards of a bf16/fp16 model: megatron-core's hybrid optimizer
    re-registers the distributed optimizer's shards, and an fp32 model's shards are views of its parameters, which
    torch refuses to optimise ("can't optimize a non-leaf Tensor")."""
    groups = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.algorithm.needs_critic else [])
    for name, group in groups:
        require(not group.optim.optimizer_cpu_offload or cfg.model.dtype in ("bfloat16", "float16"),
                f"{name}.optim.optimizer_cpu_offload",
                f"steps a bf16 or fp16 model's shards (its fp32 masters live on the host), not model.dtype="
                f"{cfg.model.dtype}: set model.dtype=bfloat16, or {name}.optim.optimizer_cpu_offload=false")


def check_rollout_groups(tensor_parallel_size: int, world_size: int, local_world_size: int) -> None:
    """Rollout groups of ``rollout.tensor_model_parallel_size`` consecutive ranks tile the world and stay on one node.

    torchrun numbers a node's ranks consecutively, so the groups stay on one node exactly when
    the group size divides the ranks per node (an engine's GPUs must be on one machine).
    """
    tp = tensor_parallel_size
    field = "rollout.tensor_model_parallel_size"
    require(tp >= 1 and world_size % tp == 0, field, f"={tp} does not divide the world size {world_size}: "
            f"use a divisor of {world_size}")
    require(local_world_size % tp == 0, field, f"={tp} does not divide the {local_world_size} ranks per node, so an "
            f"engine would span nodes: use a divisor of {local_world_size}")


def check_attention_backend(model: ModelConfig, par: ParallelConfig, *, device: str, te_importable: bool) -> None:
    """TransformerEngine's attention has a backend for the run's dtype and row layout (``device``: ``cuda``/``cpu``).

    In fp32, TE disables FlashAttention (2, 3, 4) and FusedAttention (cuDNN): both take fp16/bf16 only. What is
    left, ``UnfusedDotProductAttention``, takes no context parallelism (any TE version) and no packed (THD) rows
    with padding between them: TE <= 2.10 refuses THD outright, TE >= 2.16 refuses it with ``pad_between_seqs``,
    which TE >= 2.18 sets whenever ``cu_seqlens_*_padded`` are passed, as every packed micro-batch does here
    (rows are padded for CP, SP and the VPP pad segment). Source: ``get_attention_backend`` in TransformerEngine's
    ``pytorch/attention/dot_product_attention/utils.py`` ("Filter: Data type", "Filter: QKV layout", "Filter:
    Context parallelism") and the ``pad_between_seqs`` auto-detection in ``dot_product_attention.py``. The run
    would stop at its first forward with "No dot product attention backend is available"; this says so first.
    Only TE 2.11-2.15 would run fp32 packed rows, on the unfused path (per-row score matrices, no fused kernel):
    refused on every version all the same, since bf16 is what a GPU run wants. Padded rows without CP keep the
    unfused backend, as does everything in fp16/bf16.
    """
    if model.dtype != "float32" or not uses_transformer_engine(model.transformer_impl, device, te_importable):
        return
    impl = model.transformer_impl
    te = "model.transformer_impl=transformer_engine" if impl == "transformer_engine" else (
        "model.transformer_impl=auto, which picks TransformerEngine on this GPU")
    cp = par.context_parallel_size
    if model.use_remove_padding:
        raise ConfigError(
            "model.dtype",
            f"=float32 with TransformerEngine's layers ({te}) and packed rows (model.use_remove_padding=true) "
            "has no attention backend: TE's THD attention runs in fp16/bf16 only: set model.dtype=bfloat16 (the GPU "
            "setting), or model.transformer_impl=local"
            + (" (slower)" if cp > 1 else ", or model.use_remove_padding=false (slower: padded micro-batches)"),
        )
    if cp > 1:
        raise ConfigError(
            "model.dtype",
            f"=float32 with TransformerEngine's layers ({te}) and context parallelism "
            f"(actor.context_parallel_size={cp}) has no attention backend: TE's fp32 attention takes no CP: set "
            "model.dtype=bfloat16 (the GPU setting), or model.transformer_impl=local (slower)",
        )


def _resolve_device(requested: str) -> str:
    """``trainer.device`` as ``cuda`` or ``cpu`` (``auto``: CUDA when torch sees a GPU)."""
    if requested in ("cpu", "cuda"):
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def validate(cfg: RLConfig, world_size: int, *, model_shape: dict[str, int | None] | None = None,
             local_world_size: int | None = None, device: str | None = None,
             te_importable: bool | None = None) -> BatchSizes:
    """Check the rules that span groups for a run on ``world_size`` ranks; return the normalised batch sizes.

    ``model_shape``: ``num_attention_heads``, ``num_query_groups``, ``num_layers`` of the checkpoint
    (None: not known yet, the model split is not checked). ``local_world_size``: ranks per node
    (None: the whole world on one node; the launcher passes torchrun's ``LOCAL_WORLD_SIZE``).
    ``device`` (``cuda``/``cpu``) and ``te_importable``: where the run trains and whether TransformerEngine is
    installed (None: this machine's, ``trainer.device`` resolved).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    world_size = trainer_world(cfg, world_size)
    check_separate_placement(cfg)
    check_layout(cfg, world_size, model_shape=model_shape, local_world_size=local_world_size, device=device,
                 te_importable=te_importable)
    check_data(cfg)
    check_algorithm(cfg)
    check_frozen_token_budgets(cfg)
    par = cfg.actor.parallel
    dp = world_size // par.model_parallel_size
    rollout_tp = cfg.rollout.tensor_model_parallel_size

    actor = _ppo_sizes("actor", cfg.actor, cfg, dp)
    critic = _ppo_sizes("critic", cfg.critic, cfg, dp) if cfg.algorithm.needs_critic else None
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    if sequences % dp:  # implied by the mini-batch rule; kept so the message is right if that rule changes
        raise ConfigError("data.train_batch_size", f"{sequences} sequences do not split over {dp} DP ranks")
    return BatchSizes(
        world_size=world_size,
        data_parallel_size=dp,
        rollout_data_parallel_size=world_size // rollout_tp,
        prompts_per_step=cfg.data.train_batch_size,
        sequences_per_step=sequences,
        sequences_per_step_per_dp=sequences // dp,
        actor=actor,
        critic=critic,
    )


def check_layout(cfg: RLConfig, world_size: int, *, model_shape: dict[str, int | None] | None,
                 local_world_size: int | None, device: str | None, te_importable: bool | None) -> None:
    """The parallel layout against the world, the model, the device and the rollout engines (``validate``'s
    arguments)."""
    par = cfg.actor.parallel
    check_world_size(par, world_size)
    if te_importable is None:
        import importlib.util

        te_importable = importlib.util.find_spec("transformer_engine") is not None
    check_attention_backend(
        cfg.model, par, device=_resolve_device(cfg.trainer.device) if device is None else device,
        te_importable=te_importable,
    )
    shape = dict(model_shape or {})
    num_experts = shape.pop("num_experts", None)
    if model_shape is not None:
        check_model_split(par, **shape)
        check_recompute_split(cfg, par, int(shape["num_layers"]))
    check_expert_split(par, world_size, num_experts=num_experts)
    check_host_optimizer(cfg)
    teacher_tp = cfg.teacher.tensor_model_parallel_size if cfg.teacher.enabled else None
    require(teacher_tp is None or world_size % teacher_tp == 0, "teacher.tensor_model_parallel_size",
            f"={teacher_tp} does not divide the world size {world_size}: use one of {_divisors(world_size)}")
    rollout_tp = cfg.rollout.tensor_model_parallel_size
    rollout_world = cfg.rollout.rollout_ranks if cfg.rollout.separate else world_size
    check_rollout_groups(rollout_tp, rollout_world, world_size if local_world_size is None else local_world_size)
    engines = rollout_world // rollout_tp
    require(
        cfg.data.train_batch_size % engines == 0,
        "data.train_batch_size",
        f"={cfg.data.train_batch_size} prompts do not split over the {engines} rollout engines "
        f"({rollout_world} rollout ranks / rollout.tensor_model_parallel_size {rollout_tp}): use a multiple of {engines}",
    )


def trainer_world(cfg: RLConfig, job_world: int) -> int:
    """The ranks that train in a job of ``job_world``: all of them, or those before ``rollout.rollout_ranks`` under
    ``rollout.placement=separate``."""
    if not cfg.rollout.separate:
        return job_world
    r = cfg.rollout.rollout_ranks
    require(r < job_world, "rollout.rollout_ranks",
            f"={r} leaves no trainer rank in a job of {job_world} ranks: launch more ranks (--nproc_per_node) or "
            f"give fewer to the rollout")
    return job_world - r


def check_separate_placement(cfg: RLConfig) -> None:
    """What separate placement does not do yet, refused in one line each (docs/placement.md)."""
    if not cfg.rollout.separate:
        return
    for key in ("param_offload", "grad_offload", "optimizer_offload"):
        require(not getattr(cfg.actor, key, False), f"actor.{key}",
                "offloads the actor while the engine generates, which under rollout.placement=separate runs on "
                "other ranks: unset it")


def check_data(cfg: RLConfig) -> None:
    """Data: something to train on, and length budgets the rollout agrees with."""
    require(
        bool(cfg.data.train_file_list) or cfg.data.synthetic.enable,
        "data.train_files",
        "no training data: set data.train_files=<parquet path(s)> or data.synthetic.enable=true",
    )
    require(
        cfg.rollout.prompt_length >= cfg.data.max_prompt_length,
        "rollout.prompt_length",
        f"={cfg.rollout.prompt_length} is shorter than data.max_prompt_length={cfg.data.max_prompt_length}: "
        "admitted prompts would fail in the engine; set rollout.prompt_length=${data.max_prompt_length}",
    )
    require(
        cfg.rollout.response_length == cfg.data.max_response_length,
        "rollout.response_length",
        f"={cfg.rollout.response_length} differs from data.max_response_length={cfg.data.max_response_length}: "
        "set rollout.response_length=${data.max_response_length}",
    )


def check_algorithm(cfg: RLConfig) -> None:
    """Algorithm <-> rollout/critic/ref: what the estimator, filtering, partial rollouts, the overlong penalty,
    interactions and the device need of the other groups."""
    if cfg.algorithm.needs_groups:
        require(
            cfg.rollout.n >= 2,
            "rollout.n",
            f"=1 but algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of one prompt: "
            "set rollout.n to 2 or more (e.g. 8)",
        )
    agent = cfg.rollout.agent
    if agent.enabled and agent.train_samples == "all" and cfg.actor.parallel.virtual_pipeline_model_parallel_size:
        require(
            cfg.model.use_remove_padding,
            "rollout.agent.train_samples",
            "=all gives a step as many rows as its episodes have samples, but virtual pipeline stages with padded "
            "micro-batches need a fixed row count: set rollout.agent.train_samples=last, or "
            "model.use_remove_padding=true (packed rows)",
        )
    if cfg.algorithm.filter_groups.enable:
        require(
            cfg.rollout.n >= 2,
            "rollout.n",
            "=1 but algorithm.filter_groups.enable=true keeps the prompt groups whose samples differ: "
            "set rollout.n to 2 or more, or turn filtering off",
        )
    pr = cfg.rollout.partial_rollout
    if pr.enable and pr.max_tokens_per_step is None:
        require(
            cfg.rollout.multi_turn.enable,
            "rollout.partial_rollout.enable",
            "=true with only a turn budget pauses requests between assistant turns; single-turn rollouts have none: "
            "set rollout.multi_turn.enable=true, or rollout.partial_rollout.max_tokens_per_step to pause mid-turn",
        )
    buffer = cfg.reward.overlong_buffer
    if buffer.enable:
        require(
            buffer.len < cfg.data.max_response_length,
            "reward.overlong_buffer.len",
            f"={buffer.len} is not below data.max_response_length={cfg.data.max_response_length}: "
            "the penalty must start inside the response budget (DAPO uses about a quarter of it)",
        )
    mt = cfg.rollout.multi_turn
    if mt.max_user_turns is not None and mt.max_user_turns > 0:
        require(
            mt.interaction_config_path is not None,
            "rollout.multi_turn.interaction_config_path",
            f"is null but rollout.multi_turn.max_user_turns={mt.max_user_turns}: point it at an interaction YAML "
            "or set max_user_turns=0",
        )
    if cfg.trainer.device == "cpu":
        require(
            "cpu" in cfg.rollout.engine.devices,
            "rollout.name",
            f"{cfg.rollout.name} needs a GPU but trainer.device=cpu: use rollout.name="
            f"{' or '.join(engines_on('cpu'))} on CPU",
        )


def check_frozen_token_budgets(cfg: RLConfig) -> None:
    """The frozen models' (ref, teacher) dynamic-batch token budgets hold one whole sequence."""
    for name, frozen in (("ref", cfg.ref), ("teacher", cfg.teacher)):
        if frozen.use_dynamic_bsz:
            longest = cfg.data.max_sequence_length
            require(
                frozen.log_prob_max_token_len_per_gpu >= longest,
                f"{name}.log_prob_max_token_len_per_gpu",
                f"={frozen.log_prob_max_token_len_per_gpu} cannot hold one sequence of {longest} tokens: raise it",
            )
