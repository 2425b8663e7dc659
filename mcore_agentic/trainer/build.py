"""Construction of a training run, in small named functions: model files, the feed's settings, workers, logging.

Each function builds one thing from the frozen :class:`~mcore_agentic.config.schema.RLConfig`
and the :class:`~mcore_agentic.parallel.layout.ParallelLayout`; :func:`build_components`
composes them into :class:`Components`, the bag the step loop (:mod:`.loop`) runs on.
Nothing here trains; nothing in the loop builds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from mcore_agentic.config.rules import BatchSizes
from mcore_agentic.config.schema import RLConfig
from mcore_agentic.parallel import comm
from mcore_agentic.utils.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mcore_agentic.algorithms.kl import AdaptiveKLController, FixedKLController
    from mcore_agentic.feed import Feed
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.layout import ParallelLayout
    from mcore_agentic.sharding.manager import ShardingManager
    from mcore_agentic.utils.gpu_metrics import GpuMetrics
    from mcore_agentic.utils.timing import PhaseTimer
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.critic import Critic
    from mcore_agentic.workers.reference import Reference
    from mcore_agentic.workers.teacher import Teacher

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- model files
def ensure_model(cfg: RLConfig) -> Path:
    """The HF checkpoint of ``model.model_path``; a missing tiny preset under ``outputs/`` is created once.

    The embedded default points at ``outputs/models/tiny_qwen2``: on a fresh machine rank 0
    writes the random tiny Qwen2 checkpoint (``make_tiny_hf_model_from_preset``; a path whose
    name has ``moe`` gets the tiny Qwen3-MoE, ``100m`` the 100M model) and the other ranks wait.
    Any other missing path is a config error.
    """
    path = Path(cfg.model.model_path)
    if (path / "config.json").is_file():
        return path
    parts = path.parts
    if not parts or parts[0] != "outputs":
        raise ConfigError(
            "model.model_path", f"{path} has no config.json: point it at a Hugging Face checkpoint directory"
        )
    from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset, preset_for_path

    preset = preset_for_path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        logger.info("creating the %s model checkpoint at %s (cached for later runs)", preset, path)
        tmp = path.with_name(f".{path.name}.tmp")
        make_tiny_hf_model_from_preset(tmp, preset, seed=cfg.seed)
        tmp.replace(path)
    comm.barrier()
    return path


def replay_routing_shape(cfg: RLConfig) -> tuple[int, int] | None:
    """``(moe_layers, top_k)`` of the routing the engine records under ``actor.moe.routing_replay``; None when
    it is ``disable``. A dense model with it on is a config error."""
    if cfg.actor.moe.routing_replay == "disable":
        return None
    from mcore_agentic.models.hf_io import load_hf_config, moe_routing_shape

    shape = moe_routing_shape(load_hf_config(cfg.model.model_path))
    if shape is None:
        raise ConfigError("actor.moe.routing_replay", f"{cfg.actor.moe.routing_replay!r} needs a mixture-of-experts "
                          f"model, {cfg.model.model_path} is dense: set it to disable")
    return shape


def build_tokenizer(model_path: str | Path, field: str = "model.model_path") -> Any:
    """The checkpoint's own tokenizer (with its chat template), never downloaded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    if getattr(tok, "chat_template", None) is None:
        raise ConfigError(field, f"the tokenizer in {model_path} has no chat template")
    return tok


def check_teacher_tokenizer(student: Any, teacher_path: str | Path) -> None:
    """A teacher scores the student's token ids as they are: refuse one whose tokenizer (vocabulary, special tokens)
    or chat template differs from the student's, in one line saying which."""
    teacher = build_tokenizer(teacher_path, "teacher.model_path")
    field = "teacher.model_path"
    if teacher.get_vocab() != student.get_vocab():
        a, b = student.get_vocab(), teacher.get_vocab()
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:2]
        raise ConfigError(field, f"{teacher_path} has another tokenizer ({len(b)} tokens against the student's "
                          f"{len(a)}; first differences {differ}): a teacher must share the student's tokenizer")
    if teacher.chat_template != student.chat_template:
        raise ConfigError(field, f"{teacher_path}'s chat template differs from the student's (model.model_path): a "
                          "teacher must render conversations exactly as the student does; copy the student's "
                          "chat template into it if that is what you mean")


def teacher_spec(cfg: RLConfig, spec: ModelSpec) -> ModelSpec:
    """The teacher's model: its checkpoint, the student's vocabulary, log-prob temperature, dtype, packing and
    parallel sizes (Megatron keeps one layout per process); no routing replay (the engine routed the student)."""
    return dataclasses.replace(spec, model_path=cfg.teacher.model_path, routing_shape=None)


def model_spec(cfg: RLConfig, *, vocab_size: int | None) -> ModelSpec:
    """The run's model, once, for every worker and the rollout engine: the ``model`` group, the actor's parallel
    sizes (Megatron keeps one layout per process: the reference and critic share them), the tokenizer's
    ``vocab_size`` (the ids the rollout engine samples, which log-probs normalise over), the temperature the
    log-probs use (the rollout's; 1 when it samples greedily) and the routing-replay shape
    (:func:`replay_routing_shape`)."""
    from mcore_agentic.models.spec import ModelSpec

    m = cfg.model
    return ModelSpec(
        model_path=m.model_path,
        dtype=m.dtype,
        transformer_impl=m.transformer_impl,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        use_remove_padding=m.use_remove_padding,
        logits_chunk_mb=m.logits_chunk_mb,
        vocab_size=vocab_size,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        routing_shape=replay_routing_shape(cfg),
        parallel=cfg.actor.parallel,
    )


# ----------------------------------------------------------------------------------- schedule
def total_steps(cfg: RLConfig, batches_per_epoch: int) -> int:
    """``trainer.total_training_steps`` if set, else epochs x batches per epoch."""
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    return cfg.trainer.total_epochs * batches_per_epoch


# ----------------------------------------------------------------------------------- workers
def build_actor(cfg: RLConfig, spec: ModelSpec, layout: Any, sizes: BatchSizes, steps: int) -> Any:
    """The policy, on the run's model ``spec`` (:func:`model_spec`)."""
    from mcore_agentic.workers.actor import Actor

    return Actor(
        cfg.actor,
        spec,
        layout,
        mini_batch_sequences=sizes.actor.mini_batch_sequences,
        total_training_steps=steps * sizes.actor.mini_batches_per_epoch * cfg.actor.ppo_epochs + cfg.trainer.sft_warmup_steps,
    )


def needs_reference(cfg: RLConfig) -> bool:
    return cfg.algorithm.use_kl_in_reward or cfg.actor.policy_loss.use_kl_loss


def build_reference(cfg: RLConfig, spec: ModelSpec, layout: Any) -> Any:
    if not needs_reference(cfg):
        return None
    from mcore_agentic.workers.reference import Reference

    return Reference(cfg.ref, spec, layout)


def build_teacher(cfg: RLConfig, spec: ModelSpec, layout: Any) -> Any:
    """The distillation teacher (None without ``teacher.model_path``)."""
    if not cfg.teacher.enabled:
        return None
    from mcore_agentic.workers.teacher import Teacher

    return Teacher(cfg.teacher, teacher_spec(cfg, spec), layout)


def build_critic(cfg: RLConfig, spec: ModelSpec, layout: Any, sizes: BatchSizes, steps: int) -> Any:
    if not cfg.algorithm.needs_critic:
        return None
    from mcore_agentic.workers.critic import Critic

    assert sizes.critic is not None
    return Critic(
        cfg.critic,
        spec,
        layout,
        mini_batch_sequences=sizes.critic.mini_batch_sequences,
        total_training_steps=steps * sizes.critic.mini_batches_per_epoch * cfg.critic.ppo_epochs,
    )


# ----------------------------------------------------------------------------------- rollout
def configure_offload(cfg: RLConfig) -> None:
    """Bound this process's pinned host memory for offloads (``actor.offload_pinned_mb``) before any worker exists."""
    from mcore_agentic.workers.offload import pinned_pool

    pinned_pool().set_limit(cfg.actor.offload_pinned_mb * 2**20)


def build_weight_sync(cfg: RLConfig, actor: Any, engine: Any, version: Any = None) -> Any:
    """The sharding manager: ``with`` it around a rollout, the engine holds the actor's current weights.

    The ``sharding`` group sets buckets and checks; what leaves the device during the rollout is
    the actor's own business (verl's ``actor.param_offload`` / ``grad_offload`` / ``optimizer_offload``).
    The trainer bumps ``.version`` after every actor update.
    """
    from mcore_agentic.sharding.manager import ShardingManager

    return ShardingManager(actor, engine, cfg.sharding, rollout_seed=cfg.seed, version=version)


# ----------------------------------------------------------------------------------- bookkeeping
def build_checkpoint_manager(cfg: RLConfig) -> Any:
    from mcore_agentic.trainer.checkpoint import CheckpointManager

    t = cfg.trainer
    return CheckpointManager(t.checkpoint_dir, max_to_keep=t.max_ckpt_to_keep, verify=t.checkpoint_verify)


def model_state_io(
    actor: Any, critic: Any, ref: Any = None, optim_from: str = "checkpoint"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checkpoint writer/reader callbacks for actor/critic model + optimizer state (Megatron dist checkpoints).

    ``ref``: pass the reference model when its weights are not the base checkpoint's (the SFT
    warm start re-anchors it), so that a resume restores the same KL anchor.
    """
    from mcore_agentic.trainer import model_checkpoint as mc

    return (mc.model_state_writers(actor=actor, critic=critic, ref=ref),
            mc.model_state_readers(actor=actor, critic=critic, ref=ref, optim_from=optim_from))


@dataclass
class Components:
    """Everything one run needs, built once."""

    cfg: RLConfig
    layout: ParallelLayout
    sizes: BatchSizes
    tokenizer: PreTrainedTokenizerBase
    feed: Feed
    """The rollout side of every step (:mod:`mcore_agentic.feed`: prompts, rollouts, rewards, the rows to their
    replicas, dumps); it built its own tools, data, placement, engine and reward function."""
    actor: Actor
    ref: Reference | None
    """None unless a KL term needs it (``algorithm.use_kl_in_reward`` or ``actor.use_kl_loss``)."""
    teacher: Teacher | None
    """None unless ``teacher.model_path`` is set (on-policy distillation)."""
    critic: Critic | None
    """None unless the advantage estimator needs values (GAE)."""
    weight_sync: ShardingManager
    kl_ctrl: FixedKLController | AdaptiveKLController
    total_steps: int
    timer: PhaseTimer
    """The step's phases (the feed times its own in it too)."""
    gpu: GpuMetrics
    """Device memory and utilisation at each phase's end (NVML; off on CPU)."""


def build_components(cfg: RLConfig, layout: Any, sizes: BatchSizes) -> Components:
    """Build the run in dependency order (model files -> tokenizer -> the feed, whose leaders build their rollout
    engines -> workers -> the weight sync).

    The feed comes before the workers (its engines size themselves from the free device memory, and are released
    before the workers are built).
    """
    from mcore_agentic.algorithms.kl import build_kl_controller
    from mcore_agentic.feed import build_feed
    from mcore_agentic.parallel.job import job_links, job_split
    from mcore_agentic.sharding.transports import WeightVersion

    ensure_model(cfg)
    tokenizer = build_tokenizer(cfg.model.model_path)
    if cfg.teacher.enabled:
        check_teacher_tokenizer(tokenizer, cfg.teacher.model_path)
    spec = model_spec(cfg, vocab_size=len(tokenizer))
    timer, gpu = build_timer(cfg)
    version = WeightVersion()  # the weight sync's: the version the engine holds, which the feed records on tokens
    feed = build_feed(feed_settings(cfg, sizes), data=cfg.data, reward=cfg.reward, seed=cfg.seed, layout=layout,
                      tokenizer=tokenizer, spec=spec, timer=timer, version=lambda: version.value, split=job_split(),
                      links=job_links())
    steps = total_steps(cfg, feed.batches_per_epoch)
    # A rollout group's other ranks wait for its leader's engine (SGLang's schedulers on their GPUs measure the
    # free memory as they start) before they build models there.
    comm.barrier()
    configure_offload(cfg)
    actor = build_actor(cfg, spec, layout, sizes, steps)
    ref = build_reference(cfg, spec, layout)
    teacher = build_teacher(cfg, spec, layout)
    critic = build_critic(cfg, spec, layout, sizes, steps)
    return Components(
        cfg=cfg,
        layout=layout,
        sizes=sizes,
        tokenizer=tokenizer,
        feed=feed,
        actor=actor,
        ref=ref,
        teacher=teacher,
        critic=critic,
        weight_sync=build_weight_sync(cfg, actor, feed.engine, version),
        kl_ctrl=build_kl_controller(cfg.algorithm.kl_ctrl),
        total_steps=steps,
        timer=timer,
        gpu=gpu,
    )


# ----------------------------------------------------------------------------------- the feed
def feed_settings(cfg: RLConfig, sizes: BatchSizes) -> Any:
    """What the feed reads of the config, in one typed object (:class:`~mcore_agentic.feed.FeedSettings`)."""
    from mcore_agentic.feed import DumpSettings, FeedSettings, wanted_fields

    t, fg = cfg.trainer, cfg.algorithm.filter_groups
    minis = [sizes.actor.mini_batch_sequences] + ([sizes.critic.mini_batch_sequences] if sizes.critic else [])
    dumps = None
    if t.rollout_data_dir is not None:
        dumps = DumpSettings(root=t.rollout_data_dir, freq=t.rollout_data_freq, fraction=t.rollout_data_fraction,
                             max_rows=t.rollout_data_max_rows, queue_size=t.rollout_data_queue_size,
                             wait_s=t.rollout_data_wait_s)
    return FeedSettings(
        rollout=cfg.rollout,
        prompts_per_step=cfg.data.train_batch_size,
        sequences_per_step=sizes.sequences_per_step,
        mini_batch_sizes=tuple(minis),
        plan_seed=cfg.actor.seed if cfg.actor.shuffle else None,
        seed=cfg.seed,
        max_response_length=cfg.data.max_response_length,
        overlong_buffer=cfg.reward.overlong_buffer,
        val_batch_size=cfg.data.val_batch_size,
        filter_metric=fg.metric if fg.enable else None,
        fields=wanted_fields(cfg),
        gigpo_state=cfg.algorithm.gigpo.state,
        row_multiple=math.lcm(*(sizes.sequences_per_step // m for m in minis)) * sizes.data_parallel_size,
        max_num_gen_batches=fg.max_num_gen_batches,
        dumps=dumps,
    )


def build_timer(cfg: RLConfig) -> tuple[Any, Any]:
    """The run's phase timer and the device metrics it reads at each phase's end (NVML; off on CPU)."""
    from mcore_agentic.utils.gpu_metrics import gpu_metrics_for
    from mcore_agentic.utils.timing import PhaseTimer

    gpu = gpu_metrics_for(cfg.trainer.device)
    timer = PhaseTimer(on_end=gpu.phase_end if gpu.enabled else None, readings=gpu.pop if gpu.enabled else None)
    return timer, gpu
