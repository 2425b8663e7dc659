"""verl's key names: the alias table, command-line and YAML translation, conflicts, hints, the migration doc."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from mcore_agentic.config import CONFIG_DIR, RLConfig, load_config, verl_lookup
from mcore_agentic.config import verl_keys as vk
from mcore_agentic.config.key_hints import suggest_key
from mcore_agentic.config.load import check_overrides, compose, translate_config, translate_overrides
from mcore_agentic.utils.errors import ConfigError, ConfigErrors
from mcore_agentic.utils.walk import build, leaf_paths

REPO = Path(__file__).resolve().parents[3]
NATIVE = frozenset(leaf_paths(RLConfig))
NATIVE_GROUPS = frozenset(".".join(p.split(".")[:i]) for p in NATIVE for i in range(1, p.count(".") + 1))

# verl's multi-turn GSM8K example: examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml (flattened; the
# older YAML quoted by the seed doc had max_turns) and run_qwen2.5-3b_gsm8k_multiturn.sh's overrides (verl 0.5.0,
# plus what the script gained later: mode, over_sample_rate, multi_stage_wake_up, global_profiler.*), each with the
# kind it must resolve to. Only over_sample_rate=0.1 is refused (its meaning differs); everything else runs.
GSM8K_YAML = """\
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True
actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""
NATIVE_KIND = "native"
REFUSED = "refused"
GSM8K_YAML_KEYS: list[tuple[str, str]] = [
    ("data.max_prompt_length=1024", NATIVE_KIND),
    ("data.max_response_length=1024", NATIVE_KIND),
    ("data.train_batch_size=256", NATIVE_KIND),
    ("data.return_raw_chat=True", vk.IGNORED),
    ("actor_rollout_ref.hybrid_engine=True", vk.IGNORED),
    ("actor_rollout_ref.rollout.name=sglang", vk.ALIAS),
    ("actor_rollout_ref.rollout.multi_turn.enable=True", vk.ALIAS),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5", vk.ALIAS),
    ("actor_rollout_ref.rollout.multi_turn.max_turns=5", vk.ALIAS),
]
GSM8K_SCRIPT_KEYS: list[tuple[str, str]] = [
    ("algorithm.adv_estimator=grpo", NATIVE_KIND),
    ("data.filter_overlong_prompts=True", NATIVE_KIND),
    ("data.truncation='error'", vk.DIFFERS),
    ("actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct", vk.ALIAS),
    ("actor_rollout_ref.actor.optim.lr=1e-6", vk.ALIAS),
    ("actor_rollout_ref.model.use_remove_padding=True", vk.ALIAS),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=256", vk.ALIAS),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", vk.ALIAS),
    ("actor_rollout_ref.actor.use_kl_loss=True", vk.ALIAS),
    ("actor_rollout_ref.actor.kl_loss_coef=0.001", vk.ALIAS),
    ("actor_rollout_ref.actor.kl_loss_type=low_var_kl", vk.ALIAS),
    ("actor_rollout_ref.actor.entropy_coeff=0", vk.ALIAS),
    ("actor_rollout_ref.model.enable_gradient_checkpointing=True", vk.ALIAS),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=False", vk.ALIAS),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload=False", vk.ALIAS),
    ("global_profiler.tool=torch_memory", vk.IGNORED),
    ("global_profiler.save_path=./mem_snapshots", vk.IGNORED),
    ("global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000", vk.IGNORED),
    ("global_profiler.global_tool_config.torch_memory.stack_depth=32", vk.IGNORED),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32", vk.IGNORED),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", vk.ALIAS),
    ("actor_rollout_ref.rollout.name=sglang", vk.ALIAS),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.5", vk.ALIAS),
    ("actor_rollout_ref.rollout.multi_stage_wake_up=True", vk.IGNORED),
    ("actor_rollout_ref.rollout.n=16", vk.ALIAS),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32", vk.ALIAS),
    ("actor_rollout_ref.ref.fsdp_config.param_offload=True", vk.ALIAS),
    ("actor_rollout_ref.rollout.over_sample_rate=0.1", REFUSED),
    ("actor_rollout_ref.rollout.mode=async", vk.IGNORED),
    ("algorithm.use_kl_in_reward=False", NATIVE_KIND),
    ("trainer.critic_warmup=0", vk.ALIAS),
    ('trainer.logger=["console","wandb"]', NATIVE_KIND),
    ("trainer.project_name=gsm8k_async_rl", NATIVE_KIND),
    ("trainer.experiment_name=qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-verify-n16", NATIVE_KIND),
    ("trainer.n_gpus_per_node=8", vk.IGNORED),
    ("trainer.nnodes=1", vk.IGNORED),
    ("trainer.save_freq=-1", NATIVE_KIND),
    ("trainer.test_freq=20", NATIVE_KIND),
    ("trainer.val_before_train=True", NATIVE_KIND),
    ("data.train_files=/data/gsm8k/train.parquet", NATIVE_KIND),
    ("data.val_files=/data/gsm8k/test.parquet", NATIVE_KIND),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path=/verl/gsm8k_tool_config.yaml", vk.ALIAS),
    ("trainer.total_epochs=15", NATIVE_KIND),
    ("actor_rollout_ref.rollout.update_weights_bucket_megabytes=512", vk.ALIAS),
]
GSM8K_KEYS = GSM8K_YAML_KEYS + GSM8K_SCRIPT_KEYS


def _kind(item: str) -> str:
    key = item.split("=", 1)[0]
    if key in NATIVE:
        return NATIVE_KIND
    entry = verl_lookup.lookup(key)
    assert entry is not None, f"{key}: not in the table"
    return entry.kind


def _fields(exc: ConfigError) -> list[str]:
    return [e.field for e in exc.errors]


# ------------------------------------------------------------------------------------------------- the table
def test_every_alias_names_a_native_key_and_no_entry_shadows_one():
    for e in vk.TABLE:
        assert e.kind in (vk.ALIAS, vk.DIFFERS, vk.IGNORED), e
        assert e.prefix not in NATIVE and e.prefix not in NATIVE_GROUPS, f"{e.verl} is a native key"
        assert not any(n.startswith(e.prefix + ".") for n in NATIVE), f"{e.verl} covers native keys"
        assert (e.kind == vk.ALIAS) == bool(e.native), e
        assert all(n in NATIVE for n in e.native), f"{e.verl} -> {e.native}: no such native key"
        assert e.kind == vk.ALIAS or e.note, f"{e.verl}: say why"
    assert set(vk.VALUE_TRANSLATIONS) <= NATIVE and set(vk.VALUE_NOTES) == set(vk.VALUE_TRANSLATIONS)
    assert len({e.verl for e in vk.TABLE}) == len(vk.TABLE)


def test_native_keys_named_in_notes_exist():
    native_roots = ("model", "data", "actor", "ref", "critic", "rollout", "algorithm", "reward", "sharding", "trainer")
    pattern = re.compile(r"(?<![\w./])((?:" + "|".join(native_roots) + r")(?:\.[\w*]+)+)")
    for e in vk.TABLE:
        for text in (e.note, e.fix):
            for key in pattern.findall(text):
                key = key.removesuffix(".*")
                known = key in NATIVE or key in NATIVE_GROUPS or verl_lookup.lookup(key) is not None  # native, or verl's
                assert known, f"{e.verl}: its note names {key}, neither a native nor a verl key"


def test_every_key_of_verl_0_5_trainer_configs_is_native_or_in_the_table():
    text = (Path(__file__).parent / "data" / "verl_0_5_keys.txt").read_text()
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert len(keys) > 400
    missing = [k for k in keys if k not in NATIVE and verl_lookup.lookup(k) is None]
    assert missing == []


def test_every_key_of_the_gsm8k_multiturn_example_resolves_to_its_kind():
    for item, kind in GSM8K_KEYS:
        got = _kind(item)
        if kind == REFUSED:
            assert got == vk.DIFFERS, item
        else:
            assert got == kind, item
    rewritten, lines = translate_overrides([item for item, _ in GSM8K_KEYS])
    # Aliases became their native keys, keys not needed here are gone; only the refused key stays in verl's name.
    assert [r for r in rewritten if r.split("=")[0].split(".")[0] in vk.VERL_ROOTS] == [
        "actor_rollout_ref.rollout.over_sample_rate=0.1"]
    assert "actor.optim.lr=1e-6" in rewritten and "rollout.multi_turn.max_assistant_turns=5" in rewritten
    assert not any(r.startswith(("trainer.n_gpus_per_node", "data.return_raw_chat", "global_profiler")) for r in rewritten)
    assert "verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in lines
    assert "trainer.n_gpus_per_node: not needed here: torchrun's --nproc_per_node sets the world size" in lines
    assert len(lines) == len(set(lines))
    with pytest.raises(ConfigError) as info:
        check_overrides(rewritten)
    assert _fields(info.value) == ["actor_rollout_ref.rollout.over_sample_rate"]
    assert "rollout.partial_rollout.enable=true" in str(info.value)


def test_the_gsm8k_example_builds_from_verls_yaml_and_script(tmp_path, caplog):
    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(GSM8K_YAML)
    argv = [item for item, kind in GSM8K_SCRIPT_KEYS if kind != REFUSED] + [f"hydra.searchpath=[file://{CONFIG_DIR}]"]
    with caplog.at_level(logging.INFO, logger="mcore_agentic.config.load"):
        cfg = load_config(compose("gsm8k_multiturn_grpo", argv, config_dir=tmp_path), overrides=argv)
    assert cfg.model.model_path == "Qwen/Qwen2.5-3B-Instruct" and cfg.model.use_remove_padding
    assert (cfg.actor.optim.lr, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu) == (1e-6, 256, 32)
    assert cfg.actor.policy_loss.use_kl_loss and cfg.actor.policy_loss.kl_loss_type == "low_var_kl"
    assert (cfg.actor.param_offload, cfg.ref.param_offload, cfg.ref.log_prob_micro_batch_size_per_gpu) == (False, True, 32)
    assert (cfg.rollout.name, cfg.rollout.n, cfg.rollout.tensor_model_parallel_size) == ("sglang", 16, 2)
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.max_assistant_turns == 5
    assert cfg.rollout.multi_turn.tool_config_path == "/verl/gsm8k_tool_config.yaml"
    assert cfg.sharding.bucket_size_mb == 512 and cfg.critic.warmup_steps == 0
    assert cfg.trainer.logger == ["console", "wandb"] and cfg.trainer.total_epochs == 15
    messages = [r.getMessage() for r in caplog.records]
    # Each verl key used is said once where it is used: the command line's by compose (translate_overrides), the
    # YAML's by load_config (rollout.name is in both).
    assert messages.count("verl key actor_rollout_ref.rollout.name -> rollout.name") == 2
    assert messages.count("actor_rollout_ref.hybrid_engine: not needed here: the trainer and the rollout engine always "
                          "share the GPUs here (colocated; the sharding manager syncs the weights in place)") == 1
    assert "verl key actor_rollout_ref.rollout.multi_turn.max_assistant_turns -> rollout.multi_turn.max_assistant_turns" \
        in messages
    assert "verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in messages


# ------------------------------------------------------------------------------------------------ YAML trees
def _tree(**groups) -> dict:
    return {"model": {"model_path": "x"}, **groups}


def test_a_verl_yaml_tree_is_translated_and_its_problems_reported_together():
    data = _tree(
        actor_rollout_ref={
            "actor": {"optim": {"lr": 2e-6, "warmup_style": "cosine"}, "clip_ratio": 0.3, "clip_ratio_high": 0.28,
                      "fsdp_config": {"wrap_policy": {"min_num_params": 0}, "param_offload": True}},
            "model": {"lora_rank": 8, "override_config": {}},
            "rollout": {"name": "sglang_async", "top_k": 0, "multi_turn": {"max_turns": None}, "nonsense": 1},
        },
        custom_reward_function={"path": "r.py", "name": "score"},
        trainer={"logger": "console", "n_gpus_per_node": 8},
        algorithm={"_target_": "verl.trainer.config.AlgoConfig", "kl_ctrl": {"_target_": "x"}},
        ray_init={"num_cpus": None},
        critic={"model": {"path": "/c", "nonsense": 1}},
    )
    out, lines, errors = translate_config(data)
    assert {e.field for e in errors} == {
        "actor_rollout_ref.model.lora_rank",  # refused: LoRA
        "actor_rollout_ref.rollout.multi_turn.max_turns",  # null has no equivalent
        "actor_rollout_ref.rollout.nonsense",  # unknown under verl's group
        "critic.model.nonsense",  # unknown under a node only verl has, in a native group
    }
    assert out["critic"] == {"model_path": "/c"}
    assert "actor_rollout_ref" not in out and "ray_init" not in out and "custom_reward_function" not in out
    assert out["actor"]["optim"] == {"lr": 2e-6, "lr_decay_style": "cosine"}
    assert (out["actor"]["clip_ratio_low"], out["actor"]["clip_ratio_high"]) == (0.3, 0.28)  # the specific key wins
    assert out["actor"]["param_offload"] is True
    assert (out["rollout"]["name"], out["rollout"]["top_k"]) == ("sglang", -1)
    assert out["reward"]["custom_reward_function"] == "r.py:score"
    assert out["trainer"] == {"logger": ["console"]} and out["algorithm"] == {"kl_ctrl": {}}
    assert "verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in lines
    assert "verl key custom_reward_function.path -> reward.custom_reward_function (with custom_reward_function.name)" in lines
    assert "verl value trainer.logger=console -> [console]" in lines
    assert len(lines) == len(set(lines))


def test_load_config_reports_translation_and_build_problems_at_once():
    data = _tree(actor_rollout_ref={"model": {"lora_rank": 8}, "actor": {"ppo_epochs": "two"}},
                 rollout={"n": 0}, trainer={"total_trainig_steps": 5})
    with pytest.raises(ConfigErrors) as info:
        load_config(data)
    assert set(_fields(info.value)) == {"actor_rollout_ref.model.lora_rank", "actor.ppo_epochs", "rollout.n",
                                        "trainer.total_trainig_steps"}
    assert len(str(info.value).splitlines()) == 4


def test_a_key_given_under_both_names_must_agree():
    # The same value under both names is fine.
    out, _, errors = translate_config(_tree(actor={"optim": {"lr": 2e-6}},
                                            actor_rollout_ref={"actor": {"optim": {"lr": 2e-6}}}))
    assert errors == [] and out["actor"]["optim"]["lr"] == 2e-6
    # Two values in the YAML: an error naming both.
    _, _, errors = translate_config(_tree(actor={"optim": {"lr": 2e-6}},
                                          actor_rollout_ref={"actor": {"optim": {"lr": 1e-6}}}))
    assert [e.field for e in errors] == ["actor_rollout_ref.actor.optim.lr"]
    assert "actor.optim.lr=2e-06" in str(errors[0])
    # A native key on the command line wins over a verl key in the YAML.
    out, lines, errors = translate_config(_tree(actor={"optim": {"lr": 3e-6}},
                                                actor_rollout_ref={"actor": {"optim": {"lr": 1e-6}}}),
                                          overrides=["actor.optim.lr=3e-6"])
    assert errors == [] and out["actor"]["optim"]["lr"] == 3e-6
    assert any("the command line's actor.optim.lr=3e-06 wins" in line for line in lines)
    # A value a shipped preset gives (the tiny model's path) yields to the verl key.
    out, _, errors = translate_config({"model": {"model_path": "outputs/models/tiny_qwen2"},
                                       "actor_rollout_ref": {"model": {"path": "/models/q"}}})
    assert errors == [] and out["model"]["model_path"] == "/models/q"
    # Two verl keys of one native key.
    _, _, errors = translate_config(_tree(trainer={"max_actor_ckpt_to_keep": 2, "max_critic_ckpt_to_keep": 3}))
    assert [e.field for e in errors] == ["trainer.max_critic_ckpt_to_keep"]


def test_command_line_aliases_conflicts_and_refusals():
    argv = ["+actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.clip_ratio=0.3",
            "actor.clip_ratio_high=0.28", "data.return_raw_chat=True", "actor_rollout_ref.model.lora_rank=0",
            "custom_reward_function.path=/r.py", "actor_rollout_ref.actor.optim.use_checkpoint_opt_param_scheduler=True",
            "model=tiny", "hydra.run.dir=x"]
    rewritten, lines = translate_overrides(argv)
    assert rewritten == ["++actor.optim.lr=1e-6", "actor.clip_ratio_low=0.3", "actor.clip_ratio_high=0.28",
                         "++custom_reward_function.path=/r.py", "trainer.resume_optim_from='checkpoint'",
                         "model=tiny", "hydra.run.dir=x"]
    assert lines[:3] == ["verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr",
                         "verl key actor_rollout_ref.actor.clip_ratio -> actor.clip_ratio_low",
                         "data.return_raw_chat: not needed here: the agent loop always renders the chat messages itself"]
    assert "actor_rollout_ref.model.lora_rank=0: not needed here: full fine-tuning only here (no LoRA)" in lines
    check_overrides(rewritten)
    check_overrides(argv)  # aliases and keys not needed here pass before translation too
    bad = ["actor_rollout_ref.actor.optim.lr=1e-6", "actor.optim.lr=2e-6", "actor_rollout_ref.model.lora_rank=8",
           "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=null", "trainer.total_trainig_steps=3",
           "actor_rollout_ref.actor.ppo_mini_batch_sze=4"]
    rewritten, _ = translate_overrides(bad)
    assert rewritten == bad  # problems stay as written, for check_overrides to name
    with pytest.raises(ConfigErrors) as info:
        check_overrides(rewritten)
    assert _fields(info.value) == ["actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.model.lora_rank",
                                   "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
                                   "trainer.total_trainig_steps", "actor_rollout_ref.actor.ppo_mini_batch_sze"]
    text = str(info.value).splitlines()
    assert "actor.optim.lr=2e-6" in text[0] and "full fine-tuning only here (no LoRA): drop the key" in text[1]
    assert "did you mean trainer.total_training_steps?" in text[3]
    assert "actor.ppo_mini_batch_size" in text[4]


def test_compose_rewrites_verl_overrides_before_hydra_and_joins_the_reward_function(caplog):
    with caplog.at_level(logging.INFO, logger="mcore_agentic.config.load"):
        cfg = compose("default_tiny", ["actor_rollout_ref.rollout.n=2", "custom_reward_function.path=my_reward.py",
                                       "custom_reward_function.name=score", "trainer.nnodes=1"])
    loaded = load_config(cfg)
    assert loaded.rollout.n == 2 and loaded.reward.custom_reward_function == "my_reward.py:score"
    messages = [r.getMessage() for r in caplog.records]
    assert "verl key actor_rollout_ref.rollout.n -> rollout.n" in messages
    assert messages.count("trainer.nnodes: not needed here: torchrun's --nnodes (or Slurm: slurm/train_multinode.sh) "
                          "sets the node count") == 1


# ----------------------------------------------------------------------------------------------------- hints
@pytest.mark.parametrize(
    ("key", "good", "wrong"),
    [
        # Wrong before: another group's key of another meaning.
        ("rollout.multi_turn.max_turns", "did you mean rollout.multi_turn.max_assistant_turns?", "max_user_turns?"),
        ("rollout.log_prob_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu", "did you mean ref."),
        ("data.name", "known keys here:", "rollout.name"),
        # Empty before ("known keys here: " and nothing).
        ("model.path", "did you mean model.model_path?", None),
        ("actor_rollout_ref.model.nonsense", "see docs/verl_migration.md", None),
        ("custom_reward_function.nonsense", "see docs/verl_migration.md", None),
        ("actor.fsdp_config.param_offload", "did you mean actor.param_offload?", None),
        ("rollout.mode", "not needed here", None),
        ("trainer.total_trainig_steps", "did you mean trainer.total_training_steps?", None),
        ("trainer.nonsense_key", "see docs/configuration.md for trainer's keys", None),
        ("rollout.multi_turns.enable", "did you mean rollout.multi_turn.enable?", None),
        ("rollout.nothing.enable", "rollout.nothing is not a group; see docs/configuration.md", None),
        ("nothing_here.x", "nothing_here is not a group; the top level holds: actor, algorithm", None),
    ],
)
def test_hints_are_never_empty_or_another_groups_key(key, good, wrong):
    with pytest.raises(ConfigError) as info:
        check_overrides([f"{key}=1"])
    message = str(info.value)
    assert message.startswith(f"{key}: unknown key; ") and good in message, message
    assert not message.rstrip().endswith("known keys here:")
    if wrong:
        assert wrong not in message, message


def test_verls_recomputation_switches_become_megatron_cores():
    rewritten, _ = translate_overrides([
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_method=block",
        "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_num_layers=2",
        "actor_rollout_ref.model.gradient_checkpointing_kwargs.use_reentrant=False",
        "critic.megatron.override_transformer_config.recompute_granularity=selective",
        "critic.megatron.override_transformer_config.recompute_modules=[core_attn,mlp]",
    ])
    assert rewritten == ["actor.recompute_granularity='full'", "actor.recompute_method='block'",
                         "actor.recompute_num_layers=2", "critic.recompute_granularity='selective'",
                         "critic.recompute_modules=['core_attn','mlp']"]
    off, _ = translate_overrides(["actor_rollout_ref.model.enable_gradient_checkpointing=False",
                                  "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=null"])
    assert off == []  # off, and verl's null: nothing set
    megatron, _ = translate_overrides(
        ["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full"])
    assert megatron == ["actor.recompute_granularity='full'"]
    with pytest.raises(ConfigError, match="override_transformer_config.apply_rope_fusion"):
        check_overrides(["actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True"])


def test_verls_optimizer_offload_overrides_become_the_host_optimizer():
    # verl's Megatron recipe for optimizer offload, as its examples spell it.
    o = "actor_rollout_ref.actor.optim.override_optimizer_config."
    rewritten, _ = translate_overrides([
        f"+{o}optimizer_offload_fraction=1", f"+{o}overlap_cpu_optimizer_d2h_h2d=True",
        f"+{o}use_precision_aware_optimizer=True", f"+{o}optimizer_cpu_offload=True",
        "+critic.optim.override_optimizer_config.optimizer_cpu_offload=True",
    ])
    assert rewritten == ["++actor.optim.optimizer_offload_fraction=1", "++actor.optim.overlap_cpu_optimizer_d2h_h2d=True",
                         "++actor.optim.optimizer_cpu_offload=True", "++critic.optim.optimizer_cpu_offload=True"]
    with pytest.raises(ConfigError, match="override_optimizer_config.fp8_recipe"):
        check_overrides([f"{o}fp8_recipe=blockwise"])


def test_keys_that_had_an_empty_or_wrong_hint_are_accepted_now():
    # Each gave "known keys here: " with nothing after it, or named another group's key.
    once_empty_or_wrong = ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                           "actor_rollout_ref.rollout.update_weights_bucket_megabytes=512",
                           "actor_rollout_ref.hybrid_engine=True", "actor_rollout_ref.rollout.multi_turn.max_turns=5",
                           "custom_reward_function.path=/r.py", "custom_reward_function.name=fn",
                           "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_stage_wake_up=True",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
                           "actor_rollout_ref.rollout.multi_turn.enable=True"]
    check_overrides(once_empty_or_wrong)
    rewritten, _ = translate_overrides(once_empty_or_wrong)
    assert "rollout.multi_turn.max_assistant_turns=5" in rewritten


def test_suggest_key_without_verl_knowledge_of_the_group():
    leaves = sorted(NATIVE)
    assert "rollout.name" not in suggest_key("name", "custom_reward_function", [], leaves)
    assert suggest_key("n", "actor", ["ppo_epochs"], leaves) == "did you mean rollout.n?"  # a distinctive name
    assert suggest_key("zzz", "trainer", [], leaves) == "see docs/configuration.md for trainer's keys"
    assert suggest_key("zzz", "trainer", ["a", "b"], leaves) == "known keys here: a, b"
    assert suggest_key("zzz", "x", [], leaves).startswith("x is not a group; the top level holds: actor, algorithm")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref: unknown key; verl's actor_rollout_ref group"):
        build(RLConfig, {"model": {"model_path": "x"}, "actor_rollout_ref": {}})


# ------------------------------------------------------------------------------------------------------ docs
def test_migration_doc_is_fresh():
    assert (REPO / "docs" / "verl_migration.md").read_text() == vk.render_markdown(), (
        "run python launch/dump_verl_migration.py"
    )


def test_load_config_resolves_input_paths_and_can_stay_quiet(tmp_path, caplog):
    (tmp_path / "tools.yaml").write_text("tools: []\n")
    data = _tree(actor_rollout_ref={"rollout": {"multi_turn": {"tool_config_path": "tools.yaml"}}})
    with caplog.at_level(logging.INFO, logger="mcore_agentic.config.load"):
        cfg = load_config(data, search_dirs=[tmp_path], log_aliases=False)
    assert cfg.rollout.multi_turn.tool_config_path == str(tmp_path / "tools.yaml")
    assert caplog.records == []
