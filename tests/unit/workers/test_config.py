"""Worker configs: defaults build, bad values name the dotted key, flattened sub-groups load."""

import pytest

from mcore_agentic.config.load import build
from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.workers.config import ActorConfig, CriticConfig, MoEConfig, OptimConfig, RefConfig


def test_defaults_build():
    assert ActorConfig().optim.lr > 0
    assert CriticConfig().value_loss.cliprange_value == 0.5
    assert RefConfig().param_offload is False


@pytest.mark.parametrize(
    ("cls", "kwargs", "key"),
    [
        (ActorConfig, {"ppo_mini_batch_size": 0}, "actor.ppo_mini_batch_size"),
        (ActorConfig, {"ppo_epochs": 0}, "actor.ppo_epochs"),
        (ActorConfig, {"ppo_max_token_len_per_gpu": -5}, "actor.ppo_max_token_len_per_gpu"),
        (CriticConfig, {"ppo_micro_batch_size_per_gpu": 0}, "critic.ppo_micro_batch_size_per_gpu"),
        (CriticConfig, {"warmup_steps": -1}, "critic.warmup_steps"),
        (RefConfig, {"log_prob_micro_batch_size_per_gpu": 0}, "ref.log_prob_micro_batch_size_per_gpu"),
        (OptimConfig, {"lr_decay_style": "step"}, "lr_decay_style"),
        (OptimConfig, {"betas": (0.9, 1.5)}, "betas"),
        (OptimConfig, {"min_lr": 1.0, "lr": 0.1}, "min_lr"),
        (MoEConfig, {"routing_replay": "R3"}, "actor.moe.routing_replay"),
        (MoEConfig, {"aux_loss_coeff": -1.0}, "actor.moe.aux_loss_coeff"),
    ],
)
def test_bad_values_name_the_field(cls, kwargs, key):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert err.value.field == key


def test_loader_fills_flattened_groups_and_prefixes_optim_errors():
    cfg = build(ActorConfig, {"tensor_model_parallel_size": 2, "clip_ratio_high": 0.28, "optim": {"lr": 3e-6}}, "actor")
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.policy_loss.clip_ratio_high == 0.28 and cfg.optim.lr == 3e-6
    with pytest.raises(ConfigError) as err:
        build(ActorConfig, {"optim": {"lr": -1.0}}, "actor")
    assert err.value.field == "actor.optim.lr"
    critic = build(CriticConfig, {"cliprange_value": 0.2}, "critic")
    assert critic.value_loss.cliprange_value == 0.2


def test_warmup_from_ratio():
    assert OptimConfig(lr_warmup_steps_ratio=0.1).warmup_steps(50) == 5
    assert OptimConfig(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5).warmup_steps(50) == 3


@pytest.mark.parametrize(("kwargs", "field", "words"), [
    ({"recompute_granularity": "partial"}, "actor.recompute_granularity", "full, selective or null"),
    ({"recompute_method": "uniform"}, "actor.recompute_method", "only with recompute_granularity=full"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2}, "actor.recompute_num_layers",
     "only with recompute_granularity=full"),
    ({"recompute_granularity": "full", "recompute_method": "even"}, "actor.recompute_method", "uniform or block"),
    ({"recompute_granularity": "full", "recompute_num_layers": 0}, "actor.recompute_num_layers", ">= 1"),
    ({"recompute_granularity": "full", "recompute_modules": ("mlp",)}, "actor.recompute_modules",
     "only with recompute_granularity=selective"),
    ({"recompute_granularity": "selective", "recompute_modules": ("moe_act",)}, "actor.recompute_modules",
     "core_attn, layernorm, mlp, moe"),
    ({"recompute_granularity": "selective", "recompute_modules": ()}, "actor.recompute_modules", "non-empty"),
])
def test_recomputation_keys_are_checked_in_one_line(kwargs, field, words):
    from mcore_agentic.workers.config import RecomputeConfig

    with pytest.raises(ConfigError) as info:
        ActorConfig(recompute=RecomputeConfig(**kwargs))
    assert info.value.field == field and words in str(info.value), str(info.value)


def test_recomputation_defaults_are_megatron_cores():
    from mcore_agentic.workers.config import RecomputeConfig

    assert RecomputeConfig().megatron_kwargs() == {}
    assert RecomputeConfig(recompute_granularity="full").megatron_kwargs() == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    assert RecomputeConfig(recompute_granularity="selective").megatron_kwargs() == {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    unit = RecomputeConfig(recompute_granularity="full", recompute_num_layers=3)
    unit.check_split(6, "critic")
    with pytest.raises(ConfigError) as info:
        unit.check_split(4, "critic")
    assert info.value.field == "critic.recompute_num_layers" and "use one of 1, 2, 4" in str(info.value)
    RecomputeConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=3).check_split(4, "a")
