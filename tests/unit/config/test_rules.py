"""Cross-group rules: verl batch-size semantics, normalisation, clear errors naming the key."""

from __future__ import annotations

import pytest

from mcore_agentic.config import ConfigError, compose, load_config, validate


def _cfg(*overrides: str):
    return load_config(compose("default_tiny", list(overrides)))


def _field(world_size: int, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(_cfg(*overrides), world_size)
    return info.value.field


def test_normalised_sizes_follow_verl_semantics():
    # 16 prompts x n=4 = 64 sequences; mini-batch 8 prompts = 32 sequences; TP=2 on 4 ranks -> DP=2.
    sizes = validate(
        _cfg(
            "data.train_batch_size=16",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_gpu=4",
            "actor.tensor_model_parallel_size=2",
        ),
        world_size=4,
    )
    assert sizes.data_parallel_size == 2 and sizes.rollout_data_parallel_size == 4
    assert sizes.sequences_per_step == 64 and sizes.sequences_per_step_per_dp == 32
    a = sizes.actor
    assert (a.mini_batch_sequences, a.mini_batch_sequences_per_dp, a.mini_batches_per_epoch) == (32, 16, 2)
    assert (a.micro_batch_size_per_gpu, a.grad_accumulation_steps) == (4, 4)
    assert sizes.critic is None  # GRPO needs no critic


def test_mini_batch_must_divide_train_batch():
    assert _field(2, "data.train_batch_size=8", "actor.ppo_mini_batch_size=3") == "actor.ppo_mini_batch_size"
    assert _field(2, "data.train_batch_size=8", "actor.ppo_mini_batch_size=16") == "actor.ppo_mini_batch_size"


def test_mini_batch_sequences_must_split_over_dp():
    # 1 prompt x n=3 = 3 sequences cannot split over 2 ranks.
    assert _field(2, "actor.ppo_mini_batch_size=1", "rollout.n=3", "actor.ppo_micro_batch_size_per_gpu=1") == (
        "actor.ppo_mini_batch_size"
    )


def test_micro_batch_must_divide_per_rank_mini_batch():
    # 4 prompts x 4 = 16 sequences / DP 2 = 8 per rank; 3 does not divide 8.
    assert _field(2, "actor.ppo_micro_batch_size_per_gpu=3") == "actor.ppo_micro_batch_size_per_gpu"
    assert _field(2, "actor.ppo_micro_batch_size_per_gpu=16") == "actor.ppo_micro_batch_size_per_gpu"


def test_dynamic_bsz_uses_token_budget():
    sizes = validate(_cfg("actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096"), 2)
    assert sizes.actor.micro_batch_size_per_gpu is None and sizes.actor.max_token_len_per_gpu == 4096
    # 320 + 96 tokens do not fit a 100-token budget.
    assert _field(2, "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100") == (
        "actor.ppo_max_token_len_per_gpu"
    )


def test_critic_checked_only_when_needed():
    assert _field(2, "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3") == "critic.ppo_mini_batch_size"
    sizes = validate(_cfg("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4"), 2)
    assert sizes.critic is not None and sizes.critic.mini_batch_sequences == 16


def test_parallel_and_rollout_sizes_divide_world():
    assert _field(2, "actor.tensor_model_parallel_size=4") == "actor.tensor_model_parallel_size"
    assert _field(4, "rollout.tensor_model_parallel_size=3") == "rollout.tensor_model_parallel_size"


def test_prompts_split_over_rollout_engines_not_training_replicas():
    # TP=2 on 4 ranks is 2 training replicas but 4 rollout engines (rollout TP=1): 6 prompts do not split.
    common = ("actor.tensor_model_parallel_size=2", "actor.ppo_mini_batch_size=6", "actor.ppo_micro_batch_size_per_gpu=3",
              "rollout.n=2")
    assert _field(4, "data.train_batch_size=6", *common) == "data.train_batch_size"
    sizes = validate(_cfg("data.train_batch_size=6", "rollout.tensor_model_parallel_size=2", *common), 4)
    assert sizes.rollout_data_parallel_size == 2 and sizes.data_parallel_size == 2


def test_group_estimators_need_several_samples():
    assert _field(2, "rollout.n=1", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=1") == "rollout.n"


def test_lengths_and_engine_consistency():
    assert _field(2, "rollout.prompt_length=32") == "rollout.prompt_length"  # below data.max_prompt_length
    assert _field(2, "rollout.response_length=32") == "rollout.response_length"
    assert _field(2, "rollout.name=sglang") == "rollout.name"  # default_tiny runs on CPU
    assert _field(2, "rollout.multi_turn.max_user_turns=2") == "rollout.multi_turn.interaction_config_path"


def test_error_message_says_how_to_fix():
    with pytest.raises(ConfigError) as info:
        validate(_cfg("actor.ppo_micro_batch_size_per_gpu=3"), 2)
    message = str(info.value)
    assert message.startswith("actor.ppo_micro_batch_size_per_gpu: ") and "use a divisor of 8" in message


def test_dynamic_sampling_and_overlong_keys_are_checked():
    assert _field(2, "rollout.n=1", "algorithm.adv_estimator=gae", "algorithm.filter_groups.enable=true") == "rollout.n"
    assert _field(2, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=48",
                  "data.max_response_length=48", "rollout.response_length=48") == "reward.overlong_buffer.len"
    with pytest.raises(ConfigError) as info:
        _cfg("algorithm.filter_groups.metric=seq_final_reward")
    assert info.value.field == "algorithm.filter_groups.metric"
    with pytest.raises(ConfigError) as info:
        _cfg("algorithm.filter_groups.max_num_gen_batches=-1")
    assert info.value.field == "algorithm.filter_groups.max_num_gen_batches"
    with pytest.raises(ConfigError) as info:
        _cfg("reward.overlong_buffer.len=0")
    assert info.value.field == "reward.overlong_buffer.len"
    ok = _cfg("algorithm.filter_groups.enable=true", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8")
    assert ok.algorithm.filter_groups.enable and ok.reward.overlong_buffer.len == 8
    validate(ok, 2)


def test_transformer_engine_decision_is_a_pure_function():
    from mcore_agentic.models.config import uses_transformer_engine as te

    assert te("auto", "cuda", True) and not te("auto", "cuda", False) and not te("auto", "cpu", True)
    assert not any(te("local", d, i) for d in ("cpu", "cuda") for i in (False, True))
    assert all(te("transformer_engine", d, i) for d in ("cpu", "cuda") for i in (False, True))  # asked: TE or refusal


def test_fp32_with_transformer_engine_and_packed_rows_is_refused():
    auto = "model.transformer_impl=auto"  # ppo_trainer.yaml's default (default_tiny pins the local spec)

    def refused(*overrides: str, device: str = "cuda", te: bool = True) -> str | None:
        try:
            validate(_cfg(auto, *overrides), 2, device=device, te_importable=te)
        except ConfigError as exc:
            return str(exc)
        return None

    message = refused()  # the defaults on a GPU machine with TE: float32, auto, packed rows
    assert message is not None and message.startswith("model.dtype: =float32")
    for fix in ("model.dtype=bfloat16", "model.transformer_impl=local", "model.use_remove_padding=false"):
        assert fix in message and refused(fix) is None, fix
    assert "model.transformer_impl=auto, which picks TransformerEngine" in message
    assert "model.transformer_impl=transformer_engine)" in refused("model.transformer_impl=transformer_engine")
    assert refused("model.dtype=float16") is None
    assert refused(device="cpu") is None and refused(te=False) is None  # auto: the local spec there
    # trainer.device resolves the device when none is given
    with pytest.raises(ConfigError, match="model.dtype"):
        validate(_cfg(auto, "trainer.device=cuda"), 2, te_importable=True)
    validate(_cfg(auto), 2, te_importable=True)  # default_tiny says trainer.device=cpu
    # context parallelism: TE's fp32 attention takes none, padded rows or not
    cp = ("actor.context_parallel_size=2",)
    message = refused(*cp, "model.use_remove_padding=false")
    assert message is not None and "actor.context_parallel_size=2" in message and "use_remove_padding" not in message
    assert refused(*cp, "model.use_remove_padding=false", "model.dtype=bfloat16") is None
    assert "use_remove_padding=false" not in refused(*cp)  # turning packing off would not help under CP



def test_agent_episodes_of_several_samples_need_packed_rows_under_vpp():
    agent = ["rollout.agent.entrypoint=examples/meter_agent.py:run", "rollout.multi_turn.tool_config_path=null"]
    vpp = ["actor.pipeline_model_parallel_size=2", "actor.virtual_pipeline_model_parallel_size=2",
           "model.use_remove_padding=false"]
    with pytest.raises(ConfigError) as info:
        validate(_cfg(*agent, *vpp), 4)
    assert info.value.field == "rollout.agent.train_samples"
    assert "use_remove_padding=true" in str(info.value)


def test_partial_rollout_budgets_are_checked():
    on = "rollout.partial_rollout.enable=true"
    # a turn budget alone needs turns to pause between; a token budget pauses single-turn rollouts too
    assert _field(2, on, "rollout.multi_turn.enable=false") == "rollout.partial_rollout.enable"
    validate(_cfg(on, "rollout.multi_turn.enable=false", "rollout.partial_rollout.max_tokens_per_step=32"), 2)
    for bad, field in (("rollout.partial_rollout.max_turns_per_step=null", "rollout.partial_rollout.max_turns_per_step"),
                       ("rollout.partial_rollout.max_tokens_per_step=0", "rollout.partial_rollout.max_tokens_per_step"),
                       ("rollout.partial_rollout.max_staleness=0", "rollout.partial_rollout.max_staleness")):
        with pytest.raises(ConfigError) as info:
            _cfg(on, bad)
        assert info.value.field == field, bad
    cfg = _cfg(on, "rollout.partial_rollout.max_turns_per_step=null", "rollout.partial_rollout.max_tokens_per_step=64",
               "rollout.partial_rollout.max_staleness=2")
    pr = cfg.rollout.partial_rollout
    assert (pr.max_turns_per_step, pr.max_tokens_per_step, pr.max_staleness) == (None, 64, 2)


def test_recomputation_units_must_divide_each_model_chunk():
    shape = {"num_attention_heads": 4, "num_query_groups": 2, "num_layers": 8}
    validate(_cfg("actor.recompute_granularity=full", "actor.recompute_num_layers=4"), 2, model_shape=shape)
    with pytest.raises(ConfigError) as info:  # PP=2 x VPP=2: chunks of 2 layers
        validate(_cfg("actor.recompute_granularity=full", "actor.recompute_num_layers=4",
                      "actor.pipeline_model_parallel_size=2", "actor.virtual_pipeline_model_parallel_size=2"), 2,
                 model_shape=shape)
    assert info.value.field == "actor.recompute_num_layers" and "the 2 layers of each model chunk" in str(info.value)
    with pytest.raises(ConfigError) as info:
        validate(_cfg("algorithm.adv_estimator=gae", "critic.recompute_granularity=full",
                      "critic.recompute_num_layers=3"), 2, model_shape=shape)
    assert info.value.field == "critic.recompute_num_layers"


@pytest.mark.parametrize("overrides, field", [
    (["actor.optim.optimizer_cpu_offload=true"], "actor.optim.optimizer_cpu_offload"),  # default_tiny is fp32
    (["model.dtype=bfloat16", "actor.optim.optimizer_cpu_offload=true", "actor.optimizer_offload=true"],
     "actor.optimizer_offload"),
    (["model.dtype=bfloat16", "actor.optim.optimizer_cpu_offload=true", "actor.use_distributed_optimizer=false"],
     "actor.optim.optimizer_cpu_offload"),
    (["model.dtype=bfloat16", "actor.optim.optimizer_cpu_offload=true", "actor.optim.optimizer_offload_fraction=0"],
     "actor.optim.optimizer_offload_fraction"),
])
def test_the_host_optimizer_refuses_what_it_cannot_honour_in_one_line(overrides, field):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(*overrides), 1)
    assert info.value.field == field and "\n" not in str(info.value)


def test_the_host_optimizer_is_accepted_for_a_bf16_model():
    validate(_cfg("model.dtype=bfloat16", "actor.optim.optimizer_cpu_offload=true"), 1)
