"""Frozen config dataclasses for the RL math: advantage estimation, KL, policy and value losses.

Field names follow verl (``algorithm.adv_estimator``, ``actor.clip_ratio_low``,
``critic.cliprange_value`` ...) so its users can carry their YAML over. Each
``__post_init__`` rejects bad values with a :class:`ConfigError` naming the key
and the allowed values. Light imports only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mcore_agentic.algorithms.estimators import ESTIMATORS, estimator
from mcore_agentic.utils.errors import ConfigError, require

GIGPO_MODES = ("mean_norm", "mean_std_norm")
GIGPO_STATES = ("observation", "history")
# "kl"/"k1", "abs", "mse"/"k2", "low_var_kl"/"k3"; a trailing "+" (e.g. "k3+") keeps the
# estimator's value but takes the gradient of k2 (straight-through), as in verl.
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_CTRL_TYPES = ("fixed", "adaptive")


def __getattr__(name: str) -> Any:
    # ADV_ESTIMATORS: the registered estimators' names (algorithms/estimators.py), read when asked, so that one
    # registered later is among them.
    if name == "ADV_ESTIMATORS":
        return tuple(ESTIMATORS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_kl_penalty(value: str, key: str) -> None:
    """Raise a ConfigError for ``key`` unless ``value`` names a supported KL estimator."""
    if value == "full":
        raise ConfigError(
            key,
            "'full' needs the whole-vocabulary distributions of policy and reference, which are never "
            f"gathered here; use one of {', '.join(KL_PENALTIES)} (optionally with a '+' suffix)",
        )
    base = value[:-1] if isinstance(value, str) and value.endswith("+") else value
    require(
        base in KL_PENALTIES,
        key,
        f"unknown KL estimator {value!r}; use one of {', '.join(KL_PENALTIES)} (optionally with a '+' suffix)",
    )


def _check_agg_mode(value: str, key: str) -> None:
    require(value in LOSS_AGG_MODES, key, f"unknown mode {value!r}; use one of {', '.join(LOSS_AGG_MODES)}")


@dataclass(frozen=True)
class KLControlConfig:
    """How the KL-in-reward coefficient evolves (``algorithm.kl_ctrl``)."""

    type: str = "fixed"
    """``fixed``: the coefficient stays ``kl_coef``; ``adaptive``: Ziegler et al. (2019) controller."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient of the KL penalty subtracted from token rewards."""
    target_kl: float = 0.1
    """Adaptive only: the per-token KL the controller steers towards."""
    horizon: int = 10000
    """Adaptive only: number of samples over which the coefficient adapts (larger = slower)."""

    def __post_init__(self) -> None:
        require(
            self.type in KL_CTRL_TYPES,
            "algorithm.kl_ctrl.type",
            f"unknown type {self.type!r}; use one of {', '.join(KL_CTRL_TYPES)}",
        )
        require(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {self.kl_coef}")
        require(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", f"must be > 0, got {self.target_kl}")
        require(self.horizon > 0, "algorithm.kl_ctrl.horizon", f"must be > 0, got {self.horizon}")


ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Correction for the rollout engine's sampling distribution differing from the trainer's (verl's
    ``algorithm.rollout_correction``). The ratio is ``pi_old / pi_rollout`` per sampled token (the trainer's
    old log-prob minus the engine's); ``sequence`` multiplies a row's token ratios, ``geometric`` takes their
    geometric mean. When to use: ``rollout/logprob_diff_mean`` well above ~0.005 (other kernels or precision in
    the engine, MoE routing, stale weights), or a rising ``actor/grad_norm`` with it."""

    rollout_is: str | None = None
    """Truncated importance sampling (TIS): weight each sampled token's policy loss by ``min(ratio, threshold)``
    at ``token``, ``sequence`` or ``geometric`` level; null: no weights."""
    rollout_is_threshold: float = 2.0
    """TIS cap (common: 1.5-5 per token, 2-10 per sequence)."""
    rollout_rs: str | None = None
    """Rejection (masked IS, MIS): drop from the policy loss every ``token`` (IcePop) or whole ``sequence`` /
    ``geometric``-mean row whose ratio leaves ``[rollout_rs_threshold_lower, rollout_rs_threshold]``; null: none."""
    rollout_rs_threshold: float = 2.0
    """Upper bound of the accepted ratio."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the accepted ratio; null: ``1 / rollout_rs_threshold``."""
    rollout_token_veto_threshold: float | None = None
    """Drop a whole row from the policy loss when any of its sampled tokens has a ratio below this (a token the
    trainer finds far less likely than the engine did); null: no veto."""

    def __post_init__(self) -> None:
        for key in ("rollout_is", "rollout_rs"):
            value = getattr(self, key)
            require(
                value is None or value in ROLLOUT_IS_LEVELS,
                f"algorithm.rollout_correction.{key}",
                f"{value!r} is not one of {', '.join(ROLLOUT_IS_LEVELS)} or null",
            )
        require(self.rollout_is_threshold > 0, "algorithm.rollout_correction.rollout_is_threshold",
                f"must be > 0, got {self.rollout_is_threshold}")
        require(self.rollout_rs_threshold > 0, "algorithm.rollout_correction.rollout_rs_threshold",
                f"must be > 0, got {self.rollout_rs_threshold}")
        require(
            self.rollout_rs_threshold_lower is None or 0 <= self.rollout_rs_threshold_lower < self.rollout_rs_threshold,
            "algorithm.rollout_correction.rollout_rs_threshold_lower",
            f"must be in [0, rollout_rs_threshold={self.rollout_rs_threshold}), got {self.rollout_rs_threshold_lower}",
        )
        require(
            self.rollout_token_veto_threshold is None or self.rollout_token_veto_threshold > 0,
            "algorithm.rollout_correction.rollout_token_veto_threshold",
            f"must be > 0 or null, got {self.rollout_token_veto_threshold}",
        )

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None or self.rollout_token_veto_threshold is not None

    @property
    def rs_lower(self) -> float:
        lower = self.rollout_rs_threshold_lower
        return 1.0 / self.rollout_rs_threshold if lower is None else lower


FILTER_GROUPS_METRICS = ("acc", "score", "seq_reward")


@dataclass(frozen=True)
class FilterGroupsConfig:
    """Dynamic sampling (DAPO, verl's ``algorithm.filter_groups``): prompt groups whose samples all got the same
    ``metric`` have zero group-relative advantage, so they cost a training step's compute and teach nothing.
    They are dropped and more prompts are rolled out until the step's batch is full. When to use: GRPO-style
    estimators once many groups are all-correct or all-wrong (``rollout/filtered_groups`` near the group count)."""

    enable: bool = False
    """Drop prompt groups with one value of ``metric`` over their samples, and over-sample to refill the batch."""
    metric: str = "acc"
    """What must vary within a kept group: ``acc`` (the reward's correctness) or ``score`` (the sequence reward:
    rule + tools + interaction + over-long penalty; ``seq_reward`` is verl's name for it)."""
    max_num_gen_batches: int = 10
    """Batches of ``data.train_batch_size`` prompts a step may draw (a sampling round each; under partial rollouts
    the step's top-up of its buffer included); 0: no limit. When the last one still leaves the batch short, the step
    fills it with filtered groups (logged as ``rollout/filled_groups``; they carry zero advantage) instead of
    stopping the run."""

    def __post_init__(self) -> None:
        require(
            self.metric in FILTER_GROUPS_METRICS,
            "algorithm.filter_groups.metric",
            f"{self.metric!r} is not one of {', '.join(FILTER_GROUPS_METRICS)} (verl's seq_final_reward needs the "
            "trainer's KL, which the rollout leaders filtering the groups do not have)",
        )
        require(self.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches",
                f"must be >= 0 (0: no limit), got {self.max_num_gen_batches}")


@dataclass(frozen=True)
class GiGPOConfig:
    """``adv_estimator=gigpo`` (group-in-group policy optimisation, verl-agent's ``algorithm.gigpo``): an episode-level
    group advantage plus ``step_advantage_w`` times a step-level one, which compares the turns of a prompt group's
    rows that acted from the same state (docs/algorithms.md)."""

    step_advantage_w: float = 1.0
    """Weight of the step-level advantage added to the episode-level one."""
    mode: str = "mean_norm"
    """``mean_norm``: episode part ``rloo`` (leave-one-out mean), step part each turn's return-to-go minus the mean of
    the *other rows'* returns-to-go from the same state: unbiased when the policy decides when to stop, as
    ``grpo_turn``. ``mean_std_norm``: verl-agent's — both parts centred on means that include the row and divided by
    the std (``algorithm.grpo_epsilon`` added)."""
    state: str = "observation"
    """What makes two turns' states the same: ``observation`` (GiGPO's anchor states: the environment's tokens just
    before the turn — the prompt for the first turn, else the tool results or user reply since the previous turn —
    are identical) or ``history`` (everything before the turn is identical: the policy's exact input)."""

    def __post_init__(self) -> None:
        require(self.step_advantage_w >= 0, "algorithm.gigpo.step_advantage_w", f"must be >= 0, got {self.step_advantage_w}")
        require(self.mode in GIGPO_MODES, "algorithm.gigpo.mode", f"{self.mode!r} is not one of {', '.join(GIGPO_MODES)}")
        require(self.state in GIGPO_STATES, "algorithm.gigpo.state",
                f"{self.state!r} is not one of {', '.join(GIGPO_STATES)}")


DISTILLATION_MODES = ("add", "only")
DISTILLATION_KLS = ("forward", "reverse")


@dataclass(frozen=True)
class DistillationConfig:
    """On-policy distillation (with ``teacher.model_path`` set): each token the student sampled gets the advantage
    ``coef * (log p_teacher - log p_student)`` — the negative per-token reverse KL to the teacher, on the student's
    own tokens only (environment tokens have none); docs/algorithms.md."""

    mode: str = "add"
    """``add``: the term is added to the task advantage of ``adv_estimator`` (task reward and teacher together);
    ``only``: it is the whole advantage (pure distillation; the task reward is still scored and reported)."""
    coef: float = 1.0
    """Weight of the per-token term (of the top-k KL loss with ``top_k``)."""
    top_k: int = 0
    """0: the teacher's signal is its log-prob of the one sampled token (a per-token advantage). k > 0: the
    teacher also returns its k most likely next tokens at each sampled position and the student is trained on
    the KL between the two distributions over those k tokens and the rest (a loss term, ``coef`` x ``kl``); the
    per-token advantage is then not added (``add``: task advantage + KL loss; ``only``: the KL loss alone)."""
    kl: str = "forward"
    """With ``top_k``: ``forward`` (``KL(teacher || student)``, the distillation loss) or ``reverse``
    (``KL(student || teacher)``) over the top k and the tail."""

    def __post_init__(self) -> None:
        require(self.mode in DISTILLATION_MODES, "algorithm.distillation.mode",
                f"{self.mode!r} is not one of {', '.join(DISTILLATION_MODES)}")
        require(self.coef > 0, "algorithm.distillation.coef", f"must be > 0, got {self.coef}")
        require(self.top_k >= 0, "algorithm.distillation.top_k", f"must be >= 0 (0: sampled tokens only), got {self.top_k}")
        require(self.kl in DISTILLATION_KLS, "algorithm.distillation.kl",
                f"{self.kl!r} is not one of {', '.join(DISTILLATION_KLS)}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """The ``algorithm`` group: advantage estimator, discounting, KL in the reward."""

    adv_estimator: str = "gae"
    """One of ``gae`` (needs a critic), ``grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``,
    ``grpo_turn`` (critic-free, turn-level: each turn's return-to-go against the other rows' at the same turn
    index, unbiased when the policy decides when to stop), ``gigpo`` (episode-level plus step-level advantages, the
    step level over turns from the same state: ``algorithm.gigpo.*``); docs/algorithms.md."""
    gamma: float = 1.0
    """Discount per *sampled* token (GAE, REINFORCE++), per *turn* (``grpo_turn``, ``gigpo``); environment tokens are not
    time steps."""
    lam: float = 1.0
    """GAE lambda (bias/variance trade-off); 1.0 = Monte-Carlo returns minus values."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide the group-centred score by the group std (False = Dr. GRPO style, centring only)."""
    grpo_epsilon: float = 1e-6
    """GRPO: added to the group std before dividing, so identical-reward groups give 0, not NaN."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_coef * KL(policy_old || ref)`` from the token rewards (needs a reference model)."""
    kl_penalty: str = "kl"
    """KL estimator used in the reward: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient schedule of the in-reward KL (``algorithm.kl_ctrl.*``)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Rollout-training mismatch correction of the policy loss (``algorithm.rollout_correction.*``)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling: drop prompt groups without reward variance, over-sample to refill (``algorithm.filter_groups.*``)."""
    gigpo: GiGPOConfig = field(default_factory=GiGPOConfig)
    """``adv_estimator=gigpo``'s settings (``algorithm.gigpo.*``)."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from ``teacher.model_path`` (``algorithm.distillation.*``; off without a teacher)."""
    turn_rewards: bool = False
    """Keep each turn's reward at the turn it belongs to (its last sampled token) instead of adding it to the
    episode's score on the last token: a tool's step rewards (``execute``) at the turn that called it, an
    interaction's turn score at the turn it answered. The episode's own rewards (the reward function, a tool's
    ``calc_reward``, the interaction's final score, the over-long penalty) stay on the last turn. Read by every
    estimator that looks at token positions (``gae``, ``reinforce_plus_plus``, ``grpo_turn``); the outcome
    estimators sum the row either way. With it, the interaction's turn scores count in the reward (without it
    they are passed to the reward function, as in verl)."""
    overlong_filtering: bool = False
    """Exclude truncated responses (``finish_reason == length``: the response budget ran out) from the policy loss;
    they still count in their group's baseline. NeMo-RL's name; DAPO's over-long filtering."""

    def __post_init__(self) -> None:
        if isinstance(self.kl_ctrl, Mapping):  # plain YAML dict -> typed group (construction, not mutation)
            object.__setattr__(self, "kl_ctrl", _from_mapping(KLControlConfig, self.kl_ctrl, "algorithm.kl_ctrl"))
        if isinstance(self.rollout_correction, Mapping):
            object.__setattr__(self, "rollout_correction", _from_mapping(
                RolloutCorrectionConfig, self.rollout_correction, "algorithm.rollout_correction"))
        if isinstance(self.gigpo, Mapping):
            object.__setattr__(self, "gigpo", _from_mapping(GiGPOConfig, self.gigpo, "algorithm.gigpo"))
        if isinstance(self.distillation, Mapping):
            object.__setattr__(self, "distillation", _from_mapping(
                DistillationConfig, self.distillation, "algorithm.distillation"))
        if isinstance(self.filter_groups, Mapping):
            object.__setattr__(self, "filter_groups", _from_mapping(
                FilterGroupsConfig, self.filter_groups, "algorithm.filter_groups"))
        estimator(self.adv_estimator)  # unknown: a ConfigError naming algorithm.adv_estimator and the known ones
        require(0.0 <= self.gamma <= 1.0, "algorithm.gamma", f"must be in [0, 1], got {self.gamma}")
        require(0.0 <= self.lam <= 1.0, "algorithm.lam", f"must be in [0, 1], got {self.lam}")
        require(self.grpo_epsilon > 0, "algorithm.grpo_epsilon", f"must be > 0, got {self.grpo_epsilon}")
        check_kl_penalty(self.kl_penalty, "algorithm.kl_penalty")

    @property
    def needs_critic(self) -> bool:
        """True when the estimator's advantages need values (its registration: ``gae``)."""
        return estimator(self.adv_estimator).needs_critic

    @property
    def needs_groups(self) -> bool:
        """True when the estimator compares the responses of one prompt (``index``/uid needed, n > 1)."""
        return estimator(self.adv_estimator).groups


@dataclass(frozen=True)
class PolicyLossConfig:
    """Actor loss settings (verl ``actor.*`` names): PPO clipping, aggregation, entropy and KL terms."""

    clip_ratio_low: float = 0.2
    """PPO lower clip: the ratio is clipped at ``1 - clip_ratio_low``."""
    clip_ratio_high: float = 0.2
    """PPO upper clip: ``1 + clip_ratio_high`` (DAPO's clip-higher uses e.g. 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (Ye et al. 2020): loss capped at ``-A * clip_ratio_c``; must be > 1."""
    loss_agg_mode: str = "token-mean"
    """``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm``."""
    loss_scale_factor: float | None = None
    """``seq-mean-token-sum-norm`` only: the constant divisor of each sequence's token sum
    (Dr. GRPO). ``None`` = the padded response length of the batch; set the max response length
    to keep it constant across micro-batches."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (the loss subtracts ``entropy_coeff * entropy``)."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(policy || ref)`` to the loss (GRPO style; instead of KL in reward)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss; same choices as ``algorithm.kl_penalty``."""

    def __post_init__(self) -> None:
        require(
            0.0 <= self.clip_ratio_low < 1.0,
            "actor.clip_ratio_low",
            f"must be in [0, 1), got {self.clip_ratio_low}",
        )
        require(self.clip_ratio_high >= 0.0, "actor.clip_ratio_high", f"must be >= 0, got {self.clip_ratio_high}")
        require(
            self.clip_ratio_c > 1.0,
            "actor.clip_ratio_c",
            f"the dual-clip bound must be > 1, got {self.clip_ratio_c}",
        )
        _check_agg_mode(self.loss_agg_mode, "actor.loss_agg_mode")
        require(
            self.loss_scale_factor is None or self.loss_scale_factor > 0,
            "actor.loss_scale_factor",
            f"must be > 0 or null, got {self.loss_scale_factor}",
        )
        require(self.entropy_coeff >= 0, "actor.entropy_coeff", f"must be >= 0, got {self.entropy_coeff}")
        require(self.kl_loss_coef >= 0, "actor.kl_loss_coef", f"must be >= 0, got {self.kl_loss_coef}")
        check_kl_penalty(self.kl_loss_type, "actor.kl_loss_type")


@dataclass(frozen=True)
class ValueLossConfig:
    """Critic loss settings (verl ``critic.*`` names)."""

    cliprange_value: float = 0.5
    """Value clipping: predictions are clipped to ``old_values ± cliprange_value`` (PPO2 style)."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token value loss; same choices as ``actor.loss_agg_mode``."""

    def __post_init__(self) -> None:
        require(self.cliprange_value > 0, "critic.cliprange_value", f"must be > 0, got {self.cliprange_value}")
        _check_agg_mode(self.loss_agg_mode, "critic.loss_agg_mode")


def _from_mapping(cls: type, data: Mapping[str, Any], key: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    require(not unknown, f"{key}.{unknown[0]}" if unknown else key, f"unknown key; allowed: {', '.join(sorted(known))}")
    return cls(**dict(data))
