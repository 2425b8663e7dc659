"""Frozen config dataclasses of the actor, reference and critic workers (and their optimizer).

Light imports only (dataclasses): ``mcore_agentic/config/`` composes these into
the run's tree. Sub-groups owned by other packages sit flattened in the actor's
and critic's YAML groups (``actor.tensor_model_parallel_size`` fills
``ActorConfig.parallel``, ``actor.clip_ratio_low`` fills ``ActorConfig.policy_loss``).
Megatron keeps one parallel layout per process, so the critic and reference run
with the actor's sizes. Every bad value raises
:class:`~mcore_agentic.utils.errors.ConfigError` naming ``<group>.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_agentic.algorithms.config import PolicyLossConfig, ValueLossConfig
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.utils.errors import require

_FLAT = {"flatten": True}  # sub-group keys sit directly under the parent (actor.clip_ratio_low)

_DECAY = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimConfig:
    """Adam optimizer and LR schedule of one trained model (actor or critic)."""

    lr: float = 1e-6
    """Peak learning rate (after warmup)."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = -1
    """Warmup steps (optimizer steps); -1 means use ``lr_warmup_steps_ratio``."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of ``total_training_steps`` when ``lr_warmup_steps`` is -1."""
    lr_decay_style: str = "constant"
    """LR after warmup: constant | cosine | linear (towards the floor: ``lr x min_lr_ratio``, or ``min_lr``)."""
    min_lr_ratio: float | None = None
    """Floor of cosine/linear decay as a fraction of ``lr``, in [0, 1] (verl's ``min_lr_ratio``): the floor follows
    ``lr`` when ``lr`` changes. null with ``min_lr`` null: no floor (0)."""
    min_lr: float | None = None
    """Absolute floor of cosine/linear decay, in [0, lr] (Megatron's ``--min-lr``), instead of ``min_lr_ratio``: set
    one of the two, never both."""
    total_training_steps: int = -1
    """Length of the LR schedule (warmup ratio and decay) in optimizer steps; -1: the run's optimizer steps,
    computed by the trainer (RL steps x mini-batches x ppo_epochs, plus the SFT warm start for the actor)."""
    optimizer_cpu_offload: bool = False
    """Keep Adam on the host: megatron-core's hybrid device optimizer holds the fp32 main params and both moments
    of ``optimizer_offload_fraction`` of this rank's shard in host memory and steps them on the CPU (the gradients
    go down, the updated params come back each step). Frees 12 bytes per trained parameter / data-parallel size of
    device memory at the cost of host memory and a host step. Needs a bf16/fp16 model and the distributed optimizer
    (``use_distributed_optimizer``); replaces ``optimizer_offload``. Megatron's ``--optimizer-cpu-offload``."""
    optimizer_offload_fraction: float = 1.0
    """With ``optimizer_cpu_offload``: the fraction of the shard's parameters (by count, in order) stepped on the
    host; the rest keeps a device optimizer. Megatron's ``--optimizer-offload-fraction``."""
    overlap_cpu_optimizer_d2h_h2d: bool = True
    """With ``optimizer_cpu_offload`` on a GPU: copy gradients down and parameters up on their own CUDA streams,
    each parameter stepped by its own host optimizer as soon as its gradient arrives."""

    def __post_init__(self) -> None:
        # Bare field names: the config loader puts the group path (actor.optim) in front.
        self.validate("")

    def validate(self, prefix: str) -> None:
        """Check every field; errors name ``<prefix>.<field>`` (just ``<field>`` with no prefix)."""
        prefix = prefix + "." if prefix else ""
        require(self.lr > 0, f"{prefix}lr", f"{self.lr} must be > 0, e.g. 1e-6")
        require(self.weight_decay >= 0, f"{prefix}weight_decay", f"{self.weight_decay} must be >= 0")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{prefix}betas",
            f"{self.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
        require(self.eps > 0, f"{prefix}eps", f"{self.eps} must be > 0, e.g. 1e-8")
        require(self.clip_grad >= 0, f"{prefix}clip_grad", f"{self.clip_grad} must be >= 0 (0 disables clipping)")
        require(self.lr_warmup_steps >= -1, f"{prefix}lr_warmup_steps", "must be >= 0, or -1 to use the ratio")
        require(
            0.0 <= self.lr_warmup_steps_ratio <= 1.0,
            f"{prefix}lr_warmup_steps_ratio",
            f"{self.lr_warmup_steps_ratio} must be in [0, 1]",
        )
        require(
            self.lr_decay_style in _DECAY,
            f"{prefix}lr_decay_style",
            f"{self.lr_decay_style!r} is not one of {', '.join(_DECAY)}",
        )
        require(
            self.min_lr is None or self.min_lr_ratio is None,
            f"{prefix}min_lr",
            f"{self.min_lr} and {prefix}min_lr_ratio={self.min_lr_ratio} are both set; the decay floor is one of them "
            "(min_lr: an absolute LR, min_lr_ratio: a fraction of lr): set the other to null",
        )
        require(
            self.min_lr_ratio is None or 0.0 <= self.min_lr_ratio <= 1.0,
            f"{prefix}min_lr_ratio",
            f"{self.min_lr_ratio} must be in [0, 1] (a fraction of lr)",
        )
        require(
            self.min_lr is None or 0.0 <= self.min_lr <= self.lr,
            f"{prefix}min_lr",
            f"{self.min_lr} must be in [0, lr={self.lr}] (or null, with {prefix}min_lr_ratio as a fraction of lr)",
        )
        require(
            self.total_training_steps == -1 or self.total_training_steps > 0,
            f"{prefix}total_training_steps",
            "must be > 0, or -1 to let the trainer set it from the dataset size",
        )
        require(
            0.0 < self.optimizer_offload_fraction <= 1.0,
            f"{prefix}optimizer_offload_fraction",
            f"{self.optimizer_offload_fraction} must be in (0, 1] (the share of the optimizer kept on the host)",
        )

    @property
    def floor_lr(self) -> float:
        """The LR that cosine/linear decay ends at: ``min_lr`` when set, else ``lr x min_lr_ratio`` (0 with neither)."""
        if self.min_lr is not None:
            return self.min_lr
        return self.lr * (self.min_lr_ratio or 0.0)

    def warmup_steps(self, total_steps: int) -> int:
        """Warmup length in optimizer steps for a run of ``total_steps``."""
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * total_steps)


def _validate_batching(cfg: ActorConfig | CriticConfig, group: str) -> None:
    prefix = group + "."
    require(cfg.ppo_mini_batch_size > 0, f"{prefix}ppo_mini_batch_size", "must be > 0 (prompts per optimizer step)")
    require(
        cfg.ppo_micro_batch_size_per_gpu > 0,
        f"{prefix}ppo_micro_batch_size_per_gpu",
        "must be > 0 (sequences per forward when use_dynamic_bsz=false)",
    )
    require(
        cfg.ppo_max_token_len_per_gpu > 0,
        f"{prefix}ppo_max_token_len_per_gpu",
        "must be > 0 (tokens per micro-batch when use_dynamic_bsz=true)",
    )
    require(cfg.ppo_epochs >= 1, f"{prefix}ppo_epochs", f"{cfg.ppo_epochs} must be >= 1")
    cfg.optim.validate(f"{prefix}optim")
    if cfg.optim.optimizer_cpu_offload:
        require(cfg.use_distributed_optimizer, f"{prefix}optim.optimizer_cpu_offload",
                f"needs the distributed optimizer: set {prefix}use_distributed_optimizer=true (megatron-core's hybrid "
                "optimizer steps the distributed optimizer's shards)")
        require(not cfg.optimizer_offload, f"{prefix}optimizer_offload",
                f"moves the optimizer off the GPU for the rollout, but with {prefix}optim.optimizer_cpu_offload=true it "
                f"lives on the host already: set {prefix}optimizer_offload=false")


RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "layernorm", "mlp", "moe")
"""The selective-recomputation modules of megatron-core 0.16 that apply to the models here. Its others: ``moe_act``
needs grouped-GEMM experts, which only the TE spec builds (not offered: TE does not run where the suite runs, so
it would be untested), ``mla_up_proj`` multi-latent attention and ``shared_experts`` shared experts, which the
bridges never build."""


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation of a trained model (``actor.recompute_*``, ``critic.recompute_*``): megatron-core's
    own, under its own names. Forward-only models (reference, teacher, every log-prob pass) keep no activations for
    a backward pass, so they have nothing to recompute.

    ``full``: only the input of each unit of ``recompute_num_layers`` layers is kept; the unit's forward runs again
    in the backward pass (``uniform``: every unit of each model chunk; ``block``: only the first
    ``recompute_num_layers`` layers of each chunk, the others keep everything). ``selective``: inside every layer
    the ``recompute_modules`` keep only their inputs (``core_attn``: attention's softmax, quadratic in the row
    length when attention is not fused; ``layernorm``: the two norms' outputs; ``mlp``: the dense MLP's
    intermediates; ``moe``: a mixture-of-experts layer's)."""

    recompute_granularity: str | None = None
    """``full``, ``selective``, or null (off: every activation is kept)."""
    recompute_method: str | None = None
    """With ``full``: ``uniform`` (the default) or ``block``."""
    recompute_num_layers: int | None = None
    """With ``full``: layers per recomputed unit (``uniform``; it must divide each model chunk's layers) or layers
    recomputed per chunk (``block``); default 1."""
    recompute_modules: tuple[str, ...] | None = None
    """With ``selective``: which of :data:`RECOMPUTE_MODULES`; default ``[core_attn]`` (megatron-core's)."""

    def check(self, group: str) -> None:
        """Every problem as one :class:`~mcore_agentic.utils.errors.ConfigError` naming ``<group>.<key>``."""
        g = self.recompute_granularity
        require(g in (None, "full", "selective"), f"{group}.recompute_granularity",
                f"{g!r} is not supported: use full, selective or null (off)")
        if g != "full":
            for key in ("recompute_method", "recompute_num_layers"):
                require(getattr(self, key) is None, f"{group}.{key}",
                        f"applies only with recompute_granularity=full (it is {g}): drop it")
        else:
            require(self.recompute_method in (None, "uniform", "block"), f"{group}.recompute_method",
                    f"{self.recompute_method!r} is not supported: use uniform or block")
            n = self.recompute_num_layers
            require(n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1),
                    f"{group}.recompute_num_layers", f"{n!r} must be an integer >= 1")
        if g != "selective":
            require(self.recompute_modules is None, f"{group}.recompute_modules",
                    f"applies only with recompute_granularity=selective (it is {g}): drop it")
        elif self.recompute_modules is not None:
            modules = list(self.recompute_modules)
            unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
            require(not unknown and modules, f"{group}.recompute_modules",
                    f"{unknown or modules!r}: use a non-empty list of {', '.join(RECOMPUTE_MODULES)}")

    def check_split(self, layers_per_chunk: int, group: str) -> None:
        """Full ``uniform`` recomputation cuts each model chunk (``num_layers / (PP x VPP)`` layers) into units of
        ``recompute_num_layers``: they must divide it (megatron-core would index past the chunk's last layer)."""
        if self.recompute_granularity != "full" or (self.recompute_method or "uniform") != "uniform":
            return
        n = self.recompute_num_layers or 1
        fits = [d for d in range(1, layers_per_chunk + 1) if layers_per_chunk % d == 0]
        require(layers_per_chunk % n == 0, f"{group}.recompute_num_layers",
                f"={n} does not divide the {layers_per_chunk} layers of each model chunk (num_layers / (PP x VPP)): "
                f"use one of {', '.join(map(str, fits))}, or recompute_method=block")

    def megatron_kwargs(self) -> dict[str, object]:
        """The ``TransformerConfig`` fields (defaults filled in: ``uniform``, 1 layer, ``[core_attn]``); {} when off."""
        g = self.recompute_granularity
        if g is None:
            return {}
        if g == "full":
            return {"recompute_granularity": "full", "recompute_method": self.recompute_method or "uniform",
                    "recompute_num_layers": self.recompute_num_layers or 1}
        return {"recompute_granularity": "selective", "recompute_modules": list(self.recompute_modules or ["core_attn"])}


@dataclass(frozen=True)
class MoEConfig:
    """Router losses of a mixture-of-experts actor (``actor.moe.*``; a dense model ignores them). Each is a mean
    over the mini-batch's tokens (Megatron's per-micro-batch losses weighted by their tokens and divided by the
    mini-batch's token count over all DP x CP ranks), like the policy loss, whatever the micro-batch split."""

    aux_loss_coeff: float = 0.0
    """Weight of the switch load-balancing loss (``E * sum_e f_e P_e`` per MoE layer, Megatron's ``aux_loss``);
    0: off, the default for RL (the routing is part of the policy; Qwen3-MoE pre-trained with 0.001)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE: the squared log-sum-exp of the router logits); 0: off."""
    routing_replay: str = "disable"
    """``disable``; ``measure``: the rollout engine records the experts its routers chose per token and the
    old-log-prob forward reports ``rollout/routing_agreement`` (tokens whose top-k set the trainer's routers
    share); ``rollout``: also route the old-log-prob and update forwards through the engine's experts
    (routing replay, "R3"), so the trainer scores the sampled tokens with the experts that sampled them."""

    def __post_init__(self) -> None:
        from mcore_agentic.workers.routing_replay import ROUTING_REPLAY_MODES

        require(self.routing_replay in ROUTING_REPLAY_MODES, "actor.moe.routing_replay",
                f"{self.routing_replay!r}: use one of {', '.join(ROUTING_REPLAY_MODES)}")
        require(self.aux_loss_coeff >= 0, "actor.moe.aux_loss_coeff", f"must be >= 0, got {self.aux_loss_coeff}")
        require(self.z_loss_coeff >= 0, "actor.moe.z_loss_coeff", f"must be >= 0, got {self.z_loss_coeff}")


@dataclass(frozen=True)
class ActorConfig:
    """The policy being trained (Megatron model + PPO update). The checkpoint and dtype are the ``model`` group's.

    Batch sizes count sequences (rows of the batch, i.e. prompts x samples per
    prompt) summed over data-parallel ranks, except ``*_per_gpu`` ones.
    """

    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step, all DP ranks together (verl's unit: ``* rollout.n`` sequences).

    The trainer hands the worker this value in sequences; a worker used on its own counts sequences."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Sequences per forward/backward on one rank when ``use_dynamic_bsz`` is false."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by a token budget (``ppo_max_token_len_per_gpu``) instead of a fixed size: as few as fit,
    balanced by tokens, the same number on every DP replica."""
    ppo_max_token_len_per_gpu: int = 16384
    """Tokens per micro-batch on one rank with ``use_dynamic_bsz``: packed tokens (``model.use_remove_padding``),
    or rows x padded length when padded."""
    ppo_epochs: int = 1
    """Passes over the batch per update."""
    shuffle: bool = True
    """Shuffle rows into mini-batches (seeded by ``seed`` and the update count)."""
    seed: int = 1
    """Seed of the mini-batch shuffle."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata=_FLAT)
    """TP/PP/VPP/CP sizes (keys ``actor.tensor_model_parallel_size`` ...). Megatron keeps one
    layout per process, so the critic and reference run with these sizes too."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig, metadata=_FLAT)
    """PPO clip ranges, loss aggregation, entropy and KL-loss terms (keys ``actor.clip_ratio_low`` ...)."""
    param_offload: bool = False
    """Move parameters off the device while the rollout runs (after the weight export)."""
    grad_offload: bool = False
    """Move DDP gradient buffers off the device while the rollout runs (the weight export does not read them)."""
    optimizer_offload: bool = False
    """Move optimizer state (Adam moments, fp32 main params) off the device while the rollout runs."""
    offload_pinned_mb: int = 8192
    """Most page-locked (pinned) host memory, in MiB per rank, that offloads from a GPU may hold (one pool,
    reused by every offload, shared by the actor's, critic's and reference's ``*_offload``): pinned copies run at
    full PCIe speed. Bytes past it go to ordinary pageable memory (slower copies, freed at reload). 0: never pin."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Router losses of a mixture-of-experts model (``actor.moe.*``)."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig, metadata=_FLAT)
    """Activation recomputation in the update (keys ``actor.recompute_granularity`` ...)."""

    def __post_init__(self) -> None:
        _validate_batching(self, "actor")
        self.recompute.check("actor")
        require(
            isinstance(self.offload_pinned_mb, int) and not isinstance(self.offload_pinned_mb, bool)
            and self.offload_pinned_mb >= 0,
            "actor.offload_pinned_mb",
            f"must be an integer >= 0 (MiB of pinned host memory per rank; 0 never pins), got {self.offload_pinned_mb!r}",
        )


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference policy (KL anchor): the ``model`` group's checkpoint, never updated."""

    log_prob_micro_batch_size_per_gpu: int = 8
    """Sequences per forward on one rank (when ``use_dynamic_bsz`` is false)."""
    use_dynamic_bsz: bool = False
    """Cut forward micro-batches by ``log_prob_max_token_len_per_gpu`` tokens."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget per forward micro-batch with ``use_dynamic_bsz``."""
    param_offload: bool = False
    """Keep parameters on CPU between uses (moved to the device only for ``compute_ref_log_prob``)."""

    def __post_init__(self) -> None:
        require(self.log_prob_micro_batch_size_per_gpu > 0, "ref.log_prob_micro_batch_size_per_gpu", "must be > 0")
        require(self.log_prob_max_token_len_per_gpu > 0, "ref.log_prob_max_token_len_per_gpu", "must be > 0")


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher of on-policy distillation (``algorithm.distillation``): log-probs of the student's sampled
    tokens under another model that shares the student's tokenizer and chat template. It may differ from the
    student in size, depth, width and MoE-ness; it is split like the actor, or over its own tensor-parallel groups
    (``tensor_model_parallel_size``; docs/algorithms.md says what sizes each allows)."""

    model_path: str = ""
    """HF checkpoint directory of the teacher; empty: no teacher (no distillation)."""
    tensor_model_parallel_size: int | None = None
    """null: the teacher is split as the actor is (its TP, PP, VPP, CP and EP). An integer t: its own split,
    tensor parallelism over consecutive blocks of t ranks (no pipeline, context or expert parallelism) in process
    groups of its own; each block scores the rows of every actor replica among its ranks. Must divide the world
    size; t may be larger than the actor's model-parallel size (a teacher that needs more GPUs) or smaller."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Sequences per forward on one rank (when ``use_dynamic_bsz`` is false)."""
    use_dynamic_bsz: bool = False
    """Cut forward micro-batches by ``log_prob_max_token_len_per_gpu`` tokens."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget per forward micro-batch with ``use_dynamic_bsz``."""
    param_offload: bool = False
    """Keep parameters on CPU between uses (moved to the device only to score a step)."""

    @property
    def enabled(self) -> bool:
        return bool(self.model_path)

    def __post_init__(self) -> None:
        require(self.log_prob_micro_batch_size_per_gpu > 0, "teacher.log_prob_micro_batch_size_per_gpu", "must be > 0")
        require(self.log_prob_max_token_len_per_gpu > 0, "teacher.log_prob_max_token_len_per_gpu", "must be > 0")
        require(self.tensor_model_parallel_size is None or self.tensor_model_parallel_size >= 1,
                "teacher.tensor_model_parallel_size", "must be null (the actor's split) or >= 1")


@dataclass(frozen=True)
class CriticConfig:
    """The value model: the actor's architecture with a scalar head, trained on clipped value loss."""

    model_path: str = ""
    """HF checkpoint the critic body starts from (its value head starts at zero); empty means
    ``model.model_path``. Dtype and vocab padding follow the ``model`` group."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks."""
    ppo_mini_batch_size: int = 16
    """Prompts per critic optimizer step, all DP ranks together (``* rollout.n`` sequences)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Sequences per forward/backward on one rank (fixed micro-batching)."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by ``ppo_max_token_len_per_gpu`` tokens."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget per micro-batch with ``use_dynamic_bsz``."""
    ppo_epochs: int = 1
    """Passes over the batch per update."""
    shuffle: bool = True
    """Shuffle rows into mini-batches."""
    seed: int = 1
    """Seed of the mini-batch shuffle."""
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig, metadata=_FLAT)
    """Value clip range and loss aggregation (keys ``critic.cliprange_value``, ``critic.loss_agg_mode``)."""
    warmup_steps: int = 0
    """Critic-only updates before the actor starts updating (the trainer reads it)."""
    param_offload: bool = False
    """Move parameters off the device from the end of each critic update to the next value forward."""
    grad_offload: bool = False
    """Move gradient buffers off the device between critic updates."""
    optimizer_offload: bool = False
    """Move optimizer state off the device between critic updates."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule of the critic."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig, metadata=_FLAT)
    """Activation recomputation in the critic's update (keys ``critic.recompute_granularity`` ...)."""

    def __post_init__(self) -> None:
        _validate_batching(self, "critic")
        self.recompute.check("critic")
        require(self.warmup_steps >= 0, "critic.warmup_steps", f"{self.warmup_steps} must be >= 0")


__all__ = ["ActorConfig", "CriticConfig", "OptimConfig", "RecomputeConfig", "RefConfig"]
