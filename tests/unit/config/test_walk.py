"""The generic dataclass loader: unknown keys, types, literals, flattened groups, error paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
from omegaconf import OmegaConf

from mcore_agentic.utils.errors import ConfigError, require
from mcore_agentic.utils.walk import build, leaf_paths, to_dict


@dataclass(frozen=True)
class _Par:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        require(self.tensor_model_parallel_size > 0, "tensor_model_parallel_size", "must be positive")


@dataclass(frozen=True)
class _Optim:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class _Actor:
    parallel: _Par = field(default_factory=_Par, metadata={"flatten": True})
    optim: _Optim = field(default_factory=_Optim)
    ppo_mini_batch_size: int = 4
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int | None = None
    mode: Literal["a", "b"] = "a"
    files: str | list[str] = field(default_factory=list)
    kwargs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Rollout:
    n: int = 1
    temperature: float = 1.0

    def __post_init__(self) -> None:
        require(self.temperature >= 0, "rollout.temperature", "must be >= 0")


@dataclass(frozen=True)
class _Root:
    name: str
    actor: _Actor = field(default_factory=_Actor)
    rollout: _Rollout = field(default_factory=_Rollout)


def _err(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(_Root, data)
    return info.value


def test_builds_nested_and_flattened_groups():
    cfg = build(
        _Root,
        {"name": "x", "actor": {"tensor_model_parallel_size": 2, "optim": {"lr": 1, "betas": [0.8, 0.9]}}},
    )
    assert cfg.actor.parallel.tensor_model_parallel_size == 2
    assert cfg.actor.optim.lr == 1.0 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.optim.betas == (0.8, 0.9)
    assert cfg.rollout.n == 1  # default from the dataclass
    assert to_dict(cfg)["actor"]["tensor_model_parallel_size"] == 2  # flattened back into its parent


def test_unknown_key_names_full_path_and_suggests():
    e = _err({"name": "x", "actor": {"ppo_mini_batchsize": 2}})
    assert e.field == "actor.ppo_mini_batchsize"
    assert "did you mean actor.ppo_mini_batch_size?" in str(e)


def test_unknown_key_suggests_the_same_name_in_another_group():
    e = _err({"name": "x", "actor": {"n": 8}})
    assert e.field == "actor.n" and "rollout.n" in str(e)


def test_wrong_types_name_the_key():
    assert _err({"name": "x", "rollout": {"n": "eight"}}).field == "rollout.n"
    assert _err({"name": "x", "rollout": {"n": True}}).field == "rollout.n"  # bool is not an int here
    assert _err({"name": "x", "actor": {"use_dynamic_bsz": 1}}).field == "actor.use_dynamic_bsz"
    assert _err({"name": "x", "actor": {"optim": {"betas": [0.9]}}}).field == "actor.optim.betas"
    assert _err({"name": "x", "actor": {"kwargs": {"a": "b"}}}).field == "actor.kwargs.a"
    assert _err({"name": "x", "actor": {"optim": 3}}).field == "actor.optim"


def test_literal_and_union():
    e = _err({"name": "x", "actor": {"mode": "c"}})
    assert e.field == "actor.mode" and "'a'" in str(e)
    assert build(_Root, {"name": "x", "actor": {"files": "a.parquet"}}).actor.files == "a.parquet"
    assert build(_Root, {"name": "x", "actor": {"files": ["a", "b"]}}).actor.files == ["a", "b"]
    assert build(_Root, {"name": "x", "actor": {"ppo_max_token_len_per_gpu": None}}).actor.ppo_max_token_len_per_gpu is None


def test_required_field():
    assert _err({}).field == "name"


def test_post_init_errors_get_the_group_prefix():
    e = _err({"name": "x", "actor": {"tensor_model_parallel_size": 0}})
    assert e.field == "actor.tensor_model_parallel_size"
    e = _err({"name": "x", "rollout": {"temperature": -1}})
    assert e.field == "rollout.temperature"  # already absolute: not doubled


def test_accepts_omegaconf_containers():
    cfg = OmegaConf.create({"name": "x", "rollout": {"n": 4}})
    assert build(_Root, OmegaConf.to_container(cfg, resolve=True)).rollout.n == 4


def test_leaf_paths_expand_flattened_groups():
    leaves = leaf_paths(_Root)
    assert "actor.tensor_model_parallel_size" in leaves and "actor.optim.lr" in leaves and "rollout.n" in leaves
