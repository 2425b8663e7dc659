"""The engine table (``rollout/engines/registry.py``) is the single source of what the code knows of an engine: the
config's choices, the builder, the rules' devices, the pre-flight's package and the planner's sizing come from it
(change an entry and each answer changes with it)."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from types import SimpleNamespace

import pytest

from mcore_agentic.config import ConfigError, compose, load_config, validate
from mcore_agentic.rollout.config import ENGINES, RolloutConfig
from mcore_agentic.rollout.engines import registry
from mcore_agentic.rollout.engines.base import engine_drain, engine_event_loop, engine_shutdown, prefix_cache_stats
from mcore_agentic.rollout.engines.registry import ENGINE_KINDS, ENGINE_NAMES, engine_kind, engines_on
from mcore_agentic.trainer.preflight import check_packages


def _patch(monkeypatch: pytest.MonkeyPatch, name: str, **changes: typing.Any) -> None:
    kinds = tuple(dataclasses.replace(k, **changes) if k.name == name else k for k in ENGINE_KINDS)
    monkeypatch.setattr(registry, "ENGINE_KINDS", kinds)


def test_the_configs_choices_are_the_tables_names():
    assert ENGINES == ENGINE_NAMES == ("hf", "vllm", "sglang")
    assert typing.get_args(typing.get_type_hints(RolloutConfig)["name"]) == ENGINE_NAMES
    assert [RolloutConfig(name=name).engine for name in ENGINE_NAMES] == list(ENGINE_KINDS)
    with pytest.raises(ConfigError, match="rollout.name"):
        RolloutConfig(name="trtllm")


def test_every_builder_the_table_names_exists():
    for kind in ENGINE_KINDS:
        module, _, function = kind.builder.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), kind.builder


def test_the_largest_rollout_tp_comes_from_the_table(monkeypatch):
    with pytest.raises(ConfigError, match="rollout.tensor_model_parallel_size.*set 1, or use rollout.name=sglang"):
        RolloutConfig(name="vllm", tensor_model_parallel_size=2)
    _patch(monkeypatch, "vllm", max_tensor_parallel_size=None)
    assert RolloutConfig(name="vllm", tensor_model_parallel_size=2).tensor_model_parallel_size == 2
    _patch(monkeypatch, "hf", max_tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="set 2"):
        RolloutConfig(name="hf", tensor_model_parallel_size=4)


def test_the_rules_devices_come_from_the_table(monkeypatch):
    cfg = load_config(compose("default_tiny", ["trainer.device=cpu", "rollout.name=sglang"]))
    with pytest.raises(ConfigError, match="sglang needs a GPU but trainer.device=cpu: use rollout.name=hf or vllm"):
        validate(cfg, 2)
    assert engines_on("cpu") == ("hf", "vllm") and engines_on("cuda") == ENGINE_NAMES
    _patch(monkeypatch, "sglang", devices=("cpu", "cuda"))
    validate(cfg, 2)  # the table now says it runs on CPU


def test_the_preflights_package_comes_from_the_table(monkeypatch):
    cfg = SimpleNamespace(rollout=SimpleNamespace(name="hf"), trainer=SimpleNamespace(logger=[]))
    assert check_packages(cfg) == []
    _patch(monkeypatch, "hf", package="no_such_engine_package", extras={"cuda": "hf", "cpu": "cpu"})
    [problem] = check_packages(cfg)
    assert problem.field == "rollout.name"
    assert "hf is not installed here (pip install -e '.[hf]' (cuda) or '.[cpu]' (cpu)); on CPU use rollout.name=vllm" \
        in str(problem)
    assert engine_kind("sglang").install_hint() == "pip install -e '.[sglang]'"


def test_the_planners_sizing_comes_from_the_table(monkeypatch):
    from mcore_agentic.plan.check import plan_for

    cfg = load_config(compose("default_tiny", ["rollout.name=hf"]))
    note = "rollout.name=hf: the transformers engine is not sized by gpu_memory_utilization"
    assert any(n.startswith(note) for n in plan_for(cfg, world_size=1).notes)
    _patch(monkeypatch, "hf", sized_by_gpu_memory_utilization=True)
    assert not any("not sized by" in n for n in plan_for(cfg, world_size=1).notes)


def test_optional_members_have_documented_defaults():
    bare = object()  # an engine without shutdown, drain, event_loop or prefix_cache_stats
    assert engine_event_loop(bare) is None and prefix_cache_stats(bare) is None and engine_drain(bare, 1.0) is True
    engine_shutdown(bare)
    engine_shutdown(None)  # a rank that holds no engine
    calls: list[str] = []
    full = SimpleNamespace(event_loop="loop", drain=lambda t: calls.append(f"drain {t}") or False,
                           shutdown=lambda: calls.append("shutdown"))
    assert engine_event_loop(full) == "loop" and engine_drain(full, 2.0) is False
    engine_shutdown(full)
    assert calls == ["drain 2.0", "shutdown"]
