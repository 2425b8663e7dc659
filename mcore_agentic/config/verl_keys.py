"""verl's config keys, and what each means here: the alias table behind ``docs/verl_migration.md``.

verl nests the policy, the rollout and the reference under ``actor_rollout_ref`` (``actor_rollout_ref.actor.*``,
``.rollout.*``, ``.ref.*``, ``.model.*``); here they are the top-level groups ``actor``, ``rollout``, ``ref`` and
``model``. Every verl key this project knows is one :class:`VerlKey` of :data:`TABLE`, of one of three kinds:

* ``alias`` (:data:`ALIAS`): the same meaning under another name. The loader rewrites the key to the native one
  (translating the value where verl spells it differently) and logs one line, ``verl key A -> B``.
* ``differs`` (:data:`DIFFERS`): the meaning differs here, so the key is an error whose message says what differs
  and what to write instead. Values listed in ``accept`` ask for what happens here anyway (``lora_rank: 0``,
  ``data.truncation: error``); they are accepted like a key that is not needed.
* ``not needed`` (:data:`IGNORED`): verl needs the key and this project does not (``trainer.n_gpus_per_node``:
  torchrun sets the world size). It is accepted and ignored, with one line saying why.

A key ending in ``.*`` covers that node and everything under it (an exact entry below it wins). Keys verl and
this project share (``data.train_batch_size``, ``trainer.total_epochs`` ...) are native and not listed; a few of
them take verl's spellings of their values (:data:`VALUE_TRANSLATIONS`). Pure data, standard library only:
:mod:`.verl_entry` declares an entry, :mod:`.verl_lookup` reads the table (lookups, log lines, hints),
:mod:`.verl_translate` applies it to YAML trees and command lines and :mod:`.verl_doc` renders the doc.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcore_agentic.config.verl_entry import ALIAS, DIFFERS, IGNORED, KEEP_DEFAULT, VerlKey, alias, differs, ignored


# ----------------------------------------------------------------------------------------- value translations
def _null_keeps_default(value: Any) -> Any:
    return KEEP_DEFAULT if value is None else value


def _turns(value: Any) -> Any:
    if value is None:
        raise ValueError("null (verl: up to max_model_len // 3 turns) has no equivalent here: give the number of "
                         "assistant turns, e.g. 5")
    return value


def _resume_optim(value: Any) -> Any:
    if value is True:
        return "checkpoint"
    if value is False:
        return "config"
    raise ValueError(f"expected true or false, got {value!r}")


def _logger(value: Any) -> Any:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        return value
    return ["wandb" if n == "tracking" else n for n in names]


def _engine(value: Any) -> Any:
    return {"sglang_async": "sglang", "vllm_async": "vllm"}.get(value, value) if isinstance(value, str) else value


def _top_k(value: Any) -> Any:
    return -1 if value == 0 and not isinstance(value, bool) else value


VALUE_TRANSLATIONS: dict[str, Callable[[Any], Any]] = {
    "trainer.logger": _logger,
    "rollout.name": _engine,
    "rollout.top_k": _top_k,
    "actor.optim.lr_warmup_steps": lambda v: -1 if v is None else v,
    "critic.optim.lr_warmup_steps": lambda v: -1 if v is None else v,
    "critic.ppo_micro_batch_size_per_gpu": _null_keeps_default,
}
"""Native keys verl shares, with verl's spellings of their values: a single logger name (``console``) and
``tracking`` (wandb), the ``sglang_async`` engine of verl 0.4, ``top_k: 0`` (no top-k, the HF rollout's spelling),
``lr_warmup_steps: null`` (Megatron's unset: use the ratio), a critic micro-batch of ``null`` (verl's unset)."""

VALUE_NOTES: dict[str, str] = {
    "trainer.logger": "a single name becomes a list; tracking is wandb",
    "rollout.name": "sglang_async is sglang, vllm_async is vllm",
    "rollout.top_k": "0 (no top-k) is -1",
    "actor.optim.lr_warmup_steps": "null is -1 (use lr_warmup_steps_ratio)",
    "critic.optim.lr_warmup_steps": "null is -1 (use lr_warmup_steps_ratio)",
    "critic.ppo_micro_batch_size_per_gpu": "null keeps the default",
}


# ----------------------------------------------------------------------------------------------------- notes
PROFILER = "verl's profiler settings: no profiler is built in here (run nsys or torch.profiler around the job)"
FSDP = ("FSDP settings: the models here are Megatron-core models, laid out by actor.tensor_model_parallel_size, "
        "actor.pipeline_model_parallel_size and actor.context_parallel_size, with the optimizer state sharded over "
        "data-parallel ranks by actor.use_distributed_optimizer")
ACTOR_LAYOUT = "runs with the actor's parallel layout here (actor.tensor_model_parallel_size ...)"
OLD_LOG_PROB = ("the old-log-prob forward runs on the actor with actor.ppo_micro_batch_size_per_gpu "
                "(actor.ppo_max_token_len_per_gpu with actor.use_dynamic_bsz)")
ENGINE_TUNING = "engine tuning: the engine's own defaults apply here (its memory: rollout.gpu_memory_utilization)"
BRIDGES = "models load through this project's HF-to-Megatron bridges (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama)"
GREEDY_VAL = "validation here is greedy, one sample per prompt"
MEGATRON_CKPT = "models load from the Hugging Face checkpoint (model.model_path); resumes read this project's checkpoints"
NCCL = ("verl's NCCL timeout in seconds; here trainer.dist_timeout_minutes bounds every collective, waits for the "
        "slowest rollout included")
NCCL_FIX = "set trainer.dist_timeout_minutes=<minutes> instead, above your longest rollout plus a checkpoint save"


_SHARED_OPTIM = ("lr", "weight_decay", "lr_warmup_steps", "lr_warmup_steps_ratio", "total_training_steps",
                 "min_lr", "min_lr_ratio", "clip_grad", "lr_decay_style")
"""Optimizer keys verl and this project spell alike under the model's ``optim`` group (native for the critic)."""


def _optim_entries(verl: str, native: str) -> list[VerlKey]:
    """verl's optimizer keys (FSDP and Megatron spellings) of one model, ``verl`` -> ``native`` (``actor.optim``)."""
    v, n = verl + ".", native + "."
    o = v + "override_optimizer_config."
    out = [alias(v + key, n + key) for key in _SHARED_OPTIM if key != "min_lr_ratio"]
    out += [
        alias(v + "warmup_style", n + "lr_decay_style", note="verl FSDP's schedule after warmup (constant or cosine)"),
        alias(v + "min_lr_ratio", n + "min_lr_ratio",
              note=f"the decay floor as a fraction of lr; here it is also the linear decay's, and {n}min_lr (an "
                   "absolute floor, verl Megatron's) may replace it, never both"),
        differs(v + "num_cycles", "the cosine schedule here is one half-cycle (verl's 0.5)", accept=(0.5,)),
        differs(v + "optimizer", "the optimizer is Adam with decoupled weight decay (Megatron's adam)",
                accept=("adam", "adamw", "AdamW")),
        differs(v + "lr_warmup_init", "warmup starts from a learning rate of 0 here", accept=(0,)),
        differs(v + "lr_decay_steps", f"the schedule decays over {n}total_training_steps",
                f"set {n}total_training_steps=N instead", accept=(None,)),
        ignored(v + "lr_wsd_decay_style", "used only with lr_decay_style=WSD, not available here (constant, cosine, linear)"),
        ignored(v + "lr_wsd_decay_steps", "used only with lr_decay_style=WSD, not available here (constant, cosine, linear)"),
        differs(v + "weight_decay_incr_style", "weight decay is constant here", accept=("constant",)),
        alias(v + "use_checkpoint_opt_param_scheduler", "trainer.resume_optim_from", convert=_resume_optim,
              note="on resume, whose learning-rate schedule wins: true = the checkpoint's, false = this run's config"),
        *(alias(o + key, n + key) for key in (
            "optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d")),
        ignored(o + "use_precision_aware_optimizer", "implied by optimizer_cpu_offload (megatron-core's hybrid optimizer "
                "runs on its path); without it the fp32 main params and Adam moments are fp32 as they are here"),
        ignored(o + "pin_cpu_grads", "the host optimizer's buffers are pinned wherever there is a GPU"),
        ignored(o + "pin_cpu_params", "the host optimizer's buffers are pinned wherever there is a GPU"),
    ]
    return out


def _checkpointing(value: Any) -> Any:
    if value is True:
        return "full"
    if value is False or value is None:
        return KEEP_DEFAULT
    raise ValueError(f"expected true or false, got {value!r}")


def _recompute_entries(verl_model: str, verl_megatron: str, group: str) -> list[VerlKey]:
    """verl's recomputation switches of one model: ``model.enable_gradient_checkpointing`` (full, uniform, one layer
    per unit unless ``gradient_checkpointing_kwargs`` says otherwise) and Megatron's own ``recompute_*`` under
    ``megatron.override_transformer_config``, all to ``<group>.recompute_*``."""
    m, o, g = verl_model + ".", verl_megatron + ".override_transformer_config.", group + "."
    kwargs = m + "gradient_checkpointing_kwargs."
    return [
        alias(m + "enable_gradient_checkpointing", g + "recompute_granularity", convert=_checkpointing, fallback=True,
              note="true: full recomputation (recompute_method uniform, one layer per unit, unless "
                   "gradient_checkpointing_kwargs says otherwise)"),
        alias(kwargs + "activations_checkpoint_granularity", g + "recompute_granularity", convert=_null_keeps_default),
        alias(kwargs + "activations_checkpoint_method", g + "recompute_method", convert=_null_keeps_default),
        alias(kwargs + "activations_checkpoint_num_layers", g + "recompute_num_layers", convert=_null_keeps_default),
        ignored(kwargs + "*", "FSDP's checkpointing arguments (use_reentrant): recomputation here is megatron-core's"),
        *(alias(o + key, g + key, convert=_null_keeps_default) for key in (
            "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")),
    ]


def _model_entries(verl: str) -> list[VerlKey]:
    """The model keys the actor's and the critic's ``model`` sub-groups share in verl."""
    v = verl + "."
    return [
        differs(v + "enable_activation_offload", "activation offload is not available here", accept=(False,)),
        ignored(v + "use_shm", "the checkpoint is read from its directory directly"),
        differs(v + "external_lib", BRIDGES, accept=(None,)),
        differs(v + "trust_remote_code", BRIDGES + "; no remote code runs", accept=(False,)),
        differs(v + "override_config.*", "model config overrides are not applied here",
                "edit the checkpoint's config.json instead", accept=(None, {}, False)),
        differs(v + "lora_rank", "full fine-tuning only here (no LoRA)", accept=(0,)),
        ignored(v + "lora_alpha", "a LoRA setting (LoRA is not available: lora_rank must be 0)"),
        ignored(v + "target_modules", "a LoRA setting (LoRA is not available: lora_rank must be 0)"),
        ignored(v + "exclude_modules", "a LoRA setting (LoRA is not available: lora_rank must be 0)"),
        ignored(v + "lora_adapter_path", "a LoRA setting (LoRA is not available: lora_rank must be 0)"),
    ]


def _megatron_entries(verl: str, group: str, own_layout: bool) -> list[VerlKey]:
    """``<verl>.megatron.*``: offload switches map to ``group``; the actor's parallel sizes map to its own."""
    v, g = verl + ".megatron.", group + "."
    out = [alias(v + "param_offload", g + "param_offload")]
    if group != "ref":
        out += [alias(v + "grad_offload", g + "grad_offload"), alias(v + "optimizer_offload", g + "optimizer_offload"),
                alias(v + "use_distributed_optimizer", g + "use_distributed_optimizer")]
    if own_layout:
        out += [alias(v + key, g + key) for key in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size")]
        out += [
            ignored(v + "seed", "Megatron's model-parallel RNG is seeded from seed (one seed for every RNG)"),
            differs(v + "use_dist_checkpointing", MEGATRON_CKPT, accept=(False,)),
            differs(v + "dist_checkpointing_path", MEGATRON_CKPT, accept=(None,)),
            ignored(v + "use_mbridge", "HF-to-Megatron conversion is this project's own bridges (mcore_agentic/models/)"),
            differs(v + "override_ddp_config.*", "Megatron's DDP settings are not exposed here", accept=(None, {})),
            differs(v + "override_transformer_config.*",
                    "Megatron TransformerConfig overrides other than recompute_* are not exposed here (fusions "
                    "follow model.transformer_impl)", accept=(None, {}, ["core_attn"])),
        ]
    else:
        out.append(ignored(v + "*", f"the {dict(ref='reference').get(group, group)} " + ACTOR_LAYOUT))
    return out


A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.ref."
RO = "actor_rollout_ref.rollout."
M = "actor_rollout_ref.model."

TABLE: tuple[VerlKey, ...] = (
    # ---------------------------------------------------------------------------------- actor_rollout_ref
    ignored("actor_rollout_ref.hybrid_engine", "the trainer and the rollout engine always share the GPUs here "
            "(colocated; the sharding manager syncs the weights in place)"),
    differs("actor_rollout_ref.nccl_timeout", NCCL, NCCL_FIX, accept=(600,)),
    ignored("actor_rollout_ref.profiler.*", PROFILER),
    # ---------------------------------------------------------------------------------- actor_rollout_ref.actor
    *(alias(A + key, "actor." + key) for key in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "shuffle", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
        "loss_scale_factor", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")),
    alias(A + "clip_ratio", "actor.clip_ratio_low", "actor.clip_ratio_high", fallback=True,
          note="verl's symmetric clip: it fills clip_ratio_low and clip_ratio_high where neither is set"),
    alias(A + "grad_clip", "actor.optim.clip_grad", note="verl FSDP's name of the gradient-norm clip"),
    alias(A + "data_loader_seed", "actor.seed", convert=_null_keeps_default, note="seed of the mini-batch shuffle"),
    differs(A + "ppo_micro_batch_size", "verl's micro-batch summed over all GPUs (deprecated there)",
            "set actor.ppo_micro_batch_size_per_gpu=<value / data-parallel size> instead", accept=(None,)),
    ignored(A + "strategy", "the actor is always a Megatron-core model here (fsdp, fsdp2 and megatron alike)"),
    ignored(A + "use_torch_compile", "no torch.compile here: kernels follow model.transformer_impl"),
    differs(A + "ulysses_sequence_parallel_size", "Ulysses sequence parallelism is FSDP's; Megatron splits long "
            "sequences with context parallelism", "set actor.context_parallel_size=N instead", accept=(1,)),
    ignored(A + "entropy_from_logits_with_chunking", "entropy comes from the vocab-parallel logits of each micro-batch"),
    ignored(A + "entropy_checkpointing", "entropy comes from the vocab-parallel logits of each micro-batch"),
    ignored(A + "checkpoint.*", "a checkpoint always holds what a resume needs (model, optimizer, schedule, data "
            "position); trainer.save_freq and trainer.default_local_dir place it"),
    ignored(A + "load_weight", "weights always load from model.model_path"),
    differs(A + "policy_loss.loss_mode", "only PPO's clipped policy loss (verl's vanilla) is implemented here",
            accept=("vanilla",)),
    ignored(A + "policy_loss.*", "settings of verl's other policy-loss modes (loss_mode is vanilla here)"),
    ignored(A + "profile.*", PROFILER),
    alias(A + "fsdp_config.param_offload", "actor.param_offload"),
    alias(A + "fsdp_config.optimizer_offload", "actor.optimizer_offload"),
    ignored(A + "fsdp_config.*", FSDP),
    *_optim_entries(A + "optim", "actor.optim"),
    *_megatron_entries("actor_rollout_ref.actor", "actor", own_layout=True),
    # ---------------------------------------------------------------------------------- actor_rollout_ref.ref
    alias(R + "log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size_per_gpu"),
    alias(R + "log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu"),
    alias(R + "log_prob_use_dynamic_bsz", "ref.use_dynamic_bsz"),
    differs(R + "log_prob_micro_batch_size", "verl's micro-batch summed over all GPUs (deprecated there)",
            "set ref.log_prob_micro_batch_size_per_gpu=<value / data-parallel size> instead", accept=(None,)),
    alias(R + "fsdp_config.param_offload", "ref.param_offload"),
    ignored(R + "fsdp_config.*", FSDP),
    *_megatron_entries("actor_rollout_ref.ref", "ref", own_layout=False),
    ignored(R + "strategy", "the reference is always a Megatron-core model here"),
    ignored(R + "use_torch_compile", "no torch.compile here: kernels follow model.transformer_impl"),
    ignored(R + "ulysses_sequence_parallel_size", "the reference " + ACTOR_LAYOUT),
    ignored(R + "entropy_from_logits_with_chunking", "the reference computes log-probs only"),
    ignored(R + "entropy_checkpointing", "the reference computes log-probs only"),
    ignored(R + "load_weight", "weights always load from model.model_path"),
    ignored(R + "profile.*", PROFILER),
    ignored(R + "profiler.*", PROFILER),
    # ---------------------------------------------------------------------------------- actor_rollout_ref.rollout
    *(alias(RO + key, "rollout." + key) for key in (
        "name", "n", "temperature", "top_p", "top_k", "prompt_length", "response_length", "max_model_len",
        "tensor_model_parallel_size", "gpu_memory_utilization")),
    alias(RO + "update_weights_bucket_megabytes", "sharding.bucket_size_mb",
          note="the weight sync's bucket size (MiB)"),
    ignored(RO + "mode", "rollouts here are always request-level async (the agent loop), whatever verl's mode"),
    ignored(RO + "dtype", "the engine runs in model.dtype"),
    differs(RO + "ignore_eos", "responses end at the model's end-of-sequence token here", accept=(False,)),
    differs(RO + "do_sample", "sampling is set by rollout.temperature (0 = greedy)",
            "set rollout.temperature=0 instead of do_sample=false", accept=(True,)),
    *(ignored(RO + key, ENGINE_TUNING) for key in (
        "enforce_eager", "max_num_batched_tokens", "max_num_seqs", "disable_log_stats", "enable_chunked_prefill",
        "engine_kwargs.*", "layer_name_map.*", "multi_stage_wake_up")),
    ignored(RO + "free_cache_engine", "the engine always releases its memory while the trainer's models run"),
    ignored(RO + "load_format", "the engine always receives the trainer's weights through the sharding manager"),
    ignored(RO + "layered_summon", "weights reach the engine in buckets of sharding.bucket_size_mb"),
    ignored(RO + "log_prob_micro_batch_size_per_gpu", OLD_LOG_PROB),
    ignored(RO + "log_prob_micro_batch_size", OLD_LOG_PROB),
    ignored(RO + "log_prob_use_dynamic_bsz", OLD_LOG_PROB),
    ignored(RO + "log_prob_max_token_len_per_gpu", OLD_LOG_PROB),
    ignored(RO + "calculate_log_probs", "the engine's log-prob of every sampled token is always recorded"),
    differs(RO + "val_kwargs.do_sample", GREEDY_VAL, accept=(False,)),
    differs(RO + "val_kwargs.temperature", GREEDY_VAL, accept=(0,)),
    differs(RO + "val_kwargs.n", GREEDY_VAL, accept=(1,)),
    ignored(RO + "val_kwargs.top_k", GREEDY_VAL),
    ignored(RO + "val_kwargs.top_p", GREEDY_VAL),
    ignored(RO + "agent.num_workers", "the agent loop runs on each rollout group's leader"),
    differs(RO + "agent.agent_loop_config_path", "the agent loop here is the built-in tool and interaction loop "
            "(rollout.multi_turn.*)", "drop the key; tools go in rollout.multi_turn.tool_config_path", accept=(None,)),
    differs(RO + "agent.custom_async_server.*", "custom rollout servers are not supported (engines: rollout.name)",
            accept=(None,)),
    ignored(RO + "trace.*", "no tracing integration; trainer.rollout_data_dir dumps every trajectory"),
    differs(RO + "over_sample_rate", "verl aborts the slowest fraction of requests; here long requests pause and "
            "resume next step, mid-generation under a token budget (rollout.partial_rollout.max_tokens_per_step)",
            "drop the key, or set rollout.partial_rollout.enable=true",
            accept=(0,)),
    alias(RO + "tool_kwargs.tools_config_file", "rollout.multi_turn.tool_config_path", note="verl 0.3's name"),
    alias(RO + "multi_turn", "rollout.multi_turn.enable", note="verl 0.3's switch (a boolean)"),
    *(alias(RO + "multi_turn." + key, "rollout.multi_turn." + key) for key in (
        "enable", "max_user_turns", "max_parallel_calls", "max_tool_response_length", "tool_config_path",
        "interaction_config_path", "format", "tokenization_sanity_check_mode", "use_inference_chat_template")),
    alias(RO + "multi_turn.max_assistant_turns", "rollout.multi_turn.max_assistant_turns", convert=_turns),
    alias(RO + "multi_turn.max_turns", "rollout.multi_turn.max_assistant_turns", convert=_turns, explain=True,
          note="verl 0.4.0's name: it counted assistant (generation) turns, as max_assistant_turns does; a simulated "
               "user's turns are rollout.multi_turn.max_user_turns"),
    differs(RO + "multi_turn.tool_response_truncate_side", "long tool responses are cut in the middle here",
            accept=("middle",)),
    differs(RO + "multi_turn.completion_callback", "the agent loop's turn handling is built in", accept=(None,)),
    # ---------------------------------------------------------------------------------- actor_rollout_ref.model
    alias(M + "path", "model.model_path", note="a local Hugging Face checkpoint directory (a hub id is not "
          "downloaded: fetch it first with huggingface-cli download)"),
    alias(M + "use_remove_padding", "model.use_remove_padding", note="default true here (packed rows)"),
    differs(M + "custom_chat_template", "the chat template is the checkpoint's (tokenizer_config.json)",
            "put the template in the checkpoint's tokenizer_config.json", accept=(None,)),
    ignored(M + "use_liger", "kernels follow model.transformer_impl (TransformerEngine or local)"),
    ignored(M + "use_fused_kernels", "kernels follow model.transformer_impl (TransformerEngine or local)"),
    ignored(M + "fused_kernel_options.*", "kernels follow model.transformer_impl (TransformerEngine or local)"),
    *_model_entries("actor_rollout_ref.model"),
    *_recompute_entries("actor_rollout_ref.model", "actor_rollout_ref.actor.megatron", "actor"),
    # ---------------------------------------------------------------------------------- critic
    alias("critic.model.path", "critic.model_path"),
    ignored("critic.model.tokenizer_path", "the tokenizer is model.model_path's"),
    ignored("critic.model.use_remove_padding", "one setting for every model: model.use_remove_padding"),
    alias("critic.model.fsdp_config.param_offload", "critic.param_offload"),
    alias("critic.model.fsdp_config.optimizer_offload", "critic.optimizer_offload"),
    ignored("critic.model.fsdp_config.*", FSDP),
    *_model_entries("critic.model"),
    *_recompute_entries("critic.model", "critic.megatron", "critic"),
    *_megatron_entries("critic", "critic", own_layout=False),
    alias("critic.grad_clip", "critic.optim.clip_grad", note="verl FSDP's name of the gradient-norm clip"),
    alias("critic.data_loader_seed", "critic.seed", convert=_null_keeps_default, note="seed of the mini-batch shuffle"),
    differs("critic.ppo_micro_batch_size", "verl's micro-batch summed over all GPUs (deprecated there)",
            "set critic.ppo_micro_batch_size_per_gpu=<value / data-parallel size> instead", accept=(None,)),
    ignored("critic.forward_micro_batch_size", "value forwards use critic.ppo_micro_batch_size_per_gpu"),
    ignored("critic.forward_micro_batch_size_per_gpu", "value forwards use critic.ppo_micro_batch_size_per_gpu"),
    ignored("critic.forward_max_token_len_per_gpu", "value forwards use critic.ppo_max_token_len_per_gpu"),
    ignored("critic.rollout_n", "the critic reads rollout.n"),
    ignored("critic.strategy", "the critic is always a Megatron-core model here"),
    ignored("critic.use_torch_compile", "no torch.compile here: kernels follow model.transformer_impl"),
    ignored("critic.ulysses_sequence_parallel_size", "the critic " + ACTOR_LAYOUT),
    ignored("critic.load_weight", "weights always load from critic.model_path (or model.model_path)"),
    ignored("critic.checkpoint.*", "a checkpoint always holds what a resume needs (critic included)"),
    ignored("critic.profiler.*", PROFILER),
    ignored("critic.profile.*", PROFILER),
    differs("critic.nccl_timeout", NCCL, NCCL_FIX, accept=(600,)),
    *(e for e in _optim_entries("critic.optim", "critic.optim")
      if e.verl.rsplit(".", 1)[1] not in _SHARED_OPTIM),  # the critic's shared optimizer keys are native
    # ---------------------------------------------------------------------------------- algorithm
    differs("algorithm.use_pf_ppo", "no PF-PPO reweighting here", accept=(False,)),
    ignored("algorithm.pf_ppo.*", "used only with algorithm.use_pf_ppo (not available here)"),
    # ---------------------------------------------------------------------------------- reward_model
    differs("reward_model.enable", "no model-based reward here: rules by data_source, or reward.custom_reward_function",
            "drop the key and score with reward.custom_reward_function=<file.py>:<name>", accept=(False,)),
    differs("reward_model.reward_manager", "one reward manager here (verl's naive: one call per response); DAPO's "
            "over-long penalty is reward.overlong_buffer.*", accept=("naive", "dapo")),
    alias("reward_model.overlong_buffer.enable", "reward.overlong_buffer.enable"),
    alias("reward_model.overlong_buffer.len", "reward.overlong_buffer.len"),
    alias("reward_model.overlong_buffer.penalty_factor", "reward.overlong_buffer.penalty_factor"),
    ignored("reward_model.overlong_buffer.log", "the reward parts of every trajectory are in the dumps "
            "(trainer.rollout_data_dir)"),
    alias("reward_model.reward_kwargs", "reward.reward_kwargs"),
    ignored("reward_model.launch_reward_fn_async", "reward functions run on each rollout group's leader right after "
            "its rollout"),
    differs("reward_model.sandbox_fusion.url", "reward functions do not call SandboxFusion here (code runs in the "
            "code tool's sandbox)", accept=(None,)),
    ignored("reward_model.sandbox_fusion.*", "used only with reward_model.sandbox_fusion.url"),
    ignored("reward_model.*", "reward-model settings (no reward model here: reward_model.enable must be false)"),
    # ---------------------------------------------------------------------------------- custom_reward_function
    alias("custom_reward_function.path", "reward.custom_reward_function",
          note="joined with custom_reward_function.name: reward.custom_reward_function=<path>:<name>"),
    alias("custom_reward_function.name", "reward.custom_reward_function",
          note="joined with custom_reward_function.path (default name: compute_score)"),
    alias("custom_reward_function.reward_kwargs", "reward.reward_kwargs"),
    # ---------------------------------------------------------------------------------- data
    differs("data.tokenizer", "the tokenizer is model.model_path's", accept=(None,)),
    ignored("data.use_shm", "data files are read directly"),
    differs("data.reward_fn_key", "rows pick their reward rule by their data_source column",
            "name the column data_source", accept=("data_source",)),
    ignored("data.return_raw_input_ids", "the agent loop always renders the chat messages itself"),
    ignored("data.return_raw_chat", "the agent loop always renders the chat messages itself"),
    ignored("data.return_full_prompt", "the agent loop always renders the chat messages itself"),
    ignored("data.return_multi_modal_inputs", "text-only prompts here"),
    ignored("data.image_key", "text-only prompts here"),
    ignored("data.video_key", "text-only prompts here"),
    ignored("data.dataloader_num_workers", "prompts load in the trainer's process"),
    ignored("data.validation_shuffle", "validation runs over the whole set once"),
    ignored("data.filter_overlong_prompts_workers", "over-long prompts are found in one pass at load time"),
    differs("data.truncation", "prompts are never cut here (a cut prompt changes the task); over-long ones are "
            "dropped (data.filter_overlong_prompts=true) or an error", accept=("error",)),
    differs("data.trust_remote_code", "the tokenizer loads without remote code", accept=(False,)),
    differs("data.custom_cls.*", "datasets are parquet or JSONL rows in verl's layout (docs/configuration.md)",
            "write the rows with a preprocessor (launch/preprocess_gsm8k.py is one)", accept=(None,)),
    differs("data.sampler.*", "prompts are drawn by a seeded shuffle (data.shuffle); custom samplers are not "
            "supported", accept=(None,)),
    differs("data.datagen.*", "no dynamic data generation here", accept=(None,)),
    differs("data.gen_batch_size", "with algorithm.filter_groups each sampling round draws data.train_batch_size "
            "prompts", "drop the key (rounds per step: algorithm.filter_groups.max_num_gen_batches)", accept=(None,)),
    # ---------------------------------------------------------------------------------- trainer
    ignored("trainer.n_gpus_per_node", "torchrun's --nproc_per_node sets the world size"),
    ignored("trainer.nnodes", "torchrun's --nnodes (or Slurm: slurm/train_multinode.sh) sets the node count"),
    alias("trainer.critic_warmup", "critic.warmup_steps"),
    alias("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep",
          note="one count for the whole checkpoint (actor and critic together)"),
    alias("trainer.max_critic_ckpt_to_keep", "trainer.max_ckpt_to_keep",
          note="one count for the whole checkpoint (actor and critic together)"),
    ignored("trainer.balance_batch", "rows are always balanced over data-parallel ranks by tokens"),
    ignored("trainer.profile_steps", PROFILER),
    ignored("trainer.controller_nsight_options.*", PROFILER),
    ignored("trainer.worker_nsight_options.*", PROFILER),
    ignored("trainer.npu_profile.*", PROFILER),
    ignored("trainer.log_val_generations", "validation trajectories are dumped whole under trainer.rollout_data_dir"),
    differs("trainer.validation_data_dir", "training and validation trajectories are dumped together",
            "set trainer.rollout_data_dir=<dir> instead", accept=(None,)),
    ignored("trainer.esi_redundant_time", "trainer.save_every_minutes and the stop signals (trainer.stop_signals) "
            "save before a preemption"),
    differs("trainer.val_only", "no validation-only mode here", accept=(False,)),
    differs("trainer.default_hdfs_dir", "checkpoints are written under trainer.default_local_dir only",
            accept=(None,)),
    differs("trainer.del_local_ckpt_after_load", "checkpoints are kept (trainer.max_ckpt_to_keep prunes old ones)",
            accept=(False,)),
    ignored("trainer.ray_wait_register_center_timeout", "no Ray controller here: torchrun starts the ranks"),
    ignored("trainer.use_legacy_worker_impl", "verl's choice of worker implementation"),
    # ---------------------------------------------------------------------------------- verl-only groups
    ignored("ray_init.*", "no Ray controller here: torchrun starts the ranks (Ray runs only tool calls, with "
            "rollout.multi_turn.tool_executor=ray)"),
    ignored("global_profiler.*", PROFILER),
)
"""Every verl key this project knows (verl 0.5's trainer configs, FSDP and Megatron, and the older names of its
multi-turn keys)."""

TARGET = ignored("*._target_", "verl's dataclass target of a config node")
"""``_target_`` keys of verl's config nodes (``algorithm._target_`` ...), at any depth."""


VERL_GROUPS: dict[str, str] = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "ref",
    "actor_rollout_ref.model": "model",
}
"""verl's nested groups and the native group each became."""

VERL_ROOTS: frozenset[str] = frozenset({"actor_rollout_ref", "custom_reward_function", "reward_model", "ray_init",
                                        "global_profiler"})
"""Top-level groups only verl has."""



def counts() -> dict[str, int]:
    """Entries by kind."""
    out = {ALIAS: 0, DIFFERS: 0, IGNORED: 0}
    for e in TABLE:
        out[e.kind] += 1
    return out


def render_markdown() -> str:
    """``docs/verl_migration.md`` (:func:`mcore_agentic.config.verl_doc.render_markdown`, named here for
    ``launch/dump_verl_migration.py``)."""
    from mcore_agentic.config.verl_doc import render_markdown as render

    return render()
