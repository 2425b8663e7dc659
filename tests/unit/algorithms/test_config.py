"""Tests for the algorithm config dataclasses: defaults valid, bad values name the key and the choices."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_agentic.algorithms.config import (
    AlgorithmConfig,
    KLControlConfig,
    PolicyLossConfig,
    ValueLossConfig,
)
from mcore_agentic.utils.errors import ConfigError


def test_defaults_are_valid_and_frozen():
    cfg = AlgorithmConfig()
    assert cfg.adv_estimator == "gae" and cfg.needs_critic and not cfg.needs_groups
    assert PolicyLossConfig().loss_agg_mode == "token-mean"
    assert ValueLossConfig().cliprange_value == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gamma = 0.5  # type: ignore[misc]


def test_bad_estimator_names_field_and_choices():
    with pytest.raises(ConfigError) as err:
        AlgorithmConfig(adv_estimator="ppo")
    assert err.value.field == "algorithm.adv_estimator"
    assert "grpo" in str(err.value) and "reinforce_plus_plus_baseline" in str(err.value)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: AlgorithmConfig(gamma=1.5), "algorithm.gamma"),
        (lambda: AlgorithmConfig(lam=-0.1), "algorithm.lam"),
        (lambda: AlgorithmConfig(kl_penalty="k4"), "algorithm.kl_penalty"),
        (lambda: AlgorithmConfig(kl_penalty="full"), "algorithm.kl_penalty"),
        (lambda: KLControlConfig(type="pid"), "algorithm.kl_ctrl.type"),
        (lambda: KLControlConfig(horizon=0), "algorithm.kl_ctrl.horizon"),
        (lambda: AlgorithmConfig(kl_ctrl={"type": "adaptive", "bogus": 1}), "algorithm.kl_ctrl.bogus"),
        (lambda: PolicyLossConfig(clip_ratio_c=1.0), "actor.clip_ratio_c"),
        (lambda: PolicyLossConfig(clip_ratio_low=1.0), "actor.clip_ratio_low"),
        (lambda: PolicyLossConfig(loss_agg_mode="mean"), "actor.loss_agg_mode"),
        (lambda: PolicyLossConfig(kl_loss_type="bad"), "actor.kl_loss_type"),
        (lambda: PolicyLossConfig(loss_scale_factor=0.0), "actor.loss_scale_factor"),
        (lambda: ValueLossConfig(cliprange_value=0.0), "critic.cliprange_value"),
        (lambda: ValueLossConfig(loss_agg_mode="sum"), "critic.loss_agg_mode"),
    ],
)
def test_bad_values_raise_config_error_naming_the_key(build, field):
    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.field == field


def test_kl_ctrl_from_yaml_mapping_and_straight_through_names():
    cfg = AlgorithmConfig(
        adv_estimator="grpo", kl_ctrl={"type": "adaptive", "kl_coef": 0.2}, kl_penalty="k3+", use_kl_in_reward=True
    )
    assert cfg.kl_ctrl == KLControlConfig(type="adaptive", kl_coef=0.2)
    assert cfg.needs_groups and not cfg.needs_critic
    assert PolicyLossConfig(kl_loss_type="low_var_kl+").kl_loss_type == "low_var_kl+"
