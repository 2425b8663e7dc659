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
