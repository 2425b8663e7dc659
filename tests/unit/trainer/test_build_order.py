"""The rollout engine is built, and released, before the first Megatron model holds memory (call-order test).

vLLM refuses to start unless ``rollout.gpu_memory_utilization`` x the GPU's memory is free, and SGLang sizes
itself from the memory free when it starts: built after the actor, reference and critic, both see the
trainer's models. Every builder is a recorder here; the order of their calls is the test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mcore_agentic.algorithms.kl as kl
import mcore_agentic.data.dataloader as dataloader
import mcore_agentic.feed.build as feed_build
import mcore_agentic.parallel.rollout_placement as rollout_placement
import mcore_agentic.rewards as rewards
import mcore_agentic.rollout.engines as engines
import mcore_agentic.workers.offload as offload
from mcore_agentic.config.schema import ModelConfig, RLConfig
from mcore_agentic.trainer import build
from mcore_agentic.workers.config import ActorConfig

LAYOUT = SimpleNamespace(world_size=1, rank=0)


class _Engine:
    def __init__(self, log: list[str]):
        self.log = log

    def release_memory(self) -> None:
        self.log.append("engine.release_memory")


@pytest.fixture
def log(monkeypatch) -> list[str]:
    calls: list[str] = []

    def worker(name: str):
        def make(*args, **kwargs):
            calls.append(f"{name} (pinned limit {offload.pinned_pool().limit_bytes >> 20} MiB)")
            calls.append(f"{name} draws {torch.rand(1).item():.6f}")
            return SimpleNamespace(name=name)

        return make

    def build_engine(*args, **kwargs):
        torch.rand(5)  # an engine whose construction draws from the global RNG
        calls.append("build_engine")
        return _Engine(calls)

    monkeypatch.setattr(offload, "_POOL", offload.PinnedPool(1 << 20))
    monkeypatch.setattr(build, "ensure_model", lambda cfg: None)
    monkeypatch.setattr(build, "replay_routing_shape", lambda cfg: None)
    monkeypatch.setattr(build, "build_tokenizer", lambda path: list(range(10)))
    # The feed builds itself (feed/build.py): its tools, data, placement, engine and reward function; its Roller and
    # Feed are stand-ins here that keep the engine it built.
    monkeypatch.setattr(build, "feed_settings", lambda cfg, sizes: SimpleNamespace(rollout=cfg.rollout))
    monkeypatch.setattr(feed_build, "build_tools", lambda rollout: ({}, {}, None))
    monkeypatch.setattr(feed_build, "build_datasets", lambda data, rollout, tok, tools: ([], None))
    monkeypatch.setattr(feed_build, "Roller", lambda settings, **kw: SimpleNamespace(engine=kw["engine"]))
    monkeypatch.setattr(feed_build, "Feed", lambda settings, roller, **kw: SimpleNamespace(engine=roller.engine,
                                                                                          batches_per_epoch=1))
    monkeypatch.setattr(dataloader, "make_train_loader", lambda *args: [])
    monkeypatch.setattr(build, "total_steps", lambda cfg, n: 1)
    monkeypatch.setattr(engines, "build_engine", build_engine)
    monkeypatch.setattr(build, "build_actor", worker("actor"))
    monkeypatch.setattr(build, "build_reference", worker("ref"))
    monkeypatch.setattr(build, "build_critic", worker("critic"))
    monkeypatch.setattr(build, "build_weight_sync", lambda cfg, actor, engine, version: calls.append("weight_sync"))
    monkeypatch.setattr(rewards, "build_reward_fn", lambda cfg: None)
    monkeypatch.setattr(kl, "build_kl_controller", lambda cfg: None)
    return calls


def _first_draw() -> str:
    torch.manual_seed(0)
    return f"{torch.rand(1).item():.6f}"


def test_engine_is_built_and_released_before_the_first_model(log, monkeypatch):
    monkeypatch.setattr(rollout_placement, "RolloutPlacement", lambda *args: SimpleNamespace(is_leader=True))
    cfg = RLConfig(model=ModelConfig(model_path="/ckpt"), actor=ActorConfig(offload_pinned_mb=16))
    expected_draw = _first_draw()
    torch.manual_seed(0)
    components = build.build_components(cfg, layout=LAYOUT, sizes=None)
    assert log == [
        "build_engine", "engine.release_memory",
        # the offload pool is bounded by actor.offload_pinned_mb before any worker exists
        "actor (pinned limit 16 MiB)", f"actor draws {expected_draw}",  # the engine left the RNG as it was
        "ref (pinned limit 16 MiB)", log[5], "critic (pinned limit 16 MiB)", log[7],
        "weight_sync",
    ]
    assert isinstance(components.feed.engine, _Engine)


def test_a_rank_without_an_engine_builds_the_workers_alone(log, monkeypatch):
    monkeypatch.setattr(rollout_placement, "RolloutPlacement", lambda *args: SimpleNamespace(is_leader=False))
    components = build.build_components(RLConfig(model=ModelConfig(model_path="/ckpt")), layout=LAYOUT, sizes=None)
    assert components.feed.engine is None
    assert [c for c in log if "draws" not in c] == [
        f"{w} (pinned limit {ActorConfig().offload_pinned_mb} MiB)" for w in ("actor", "ref", "critic")
    ] + ["weight_sync"]
