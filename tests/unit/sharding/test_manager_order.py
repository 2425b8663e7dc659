"""The order of a rollout's memory moves (call-order test with recorders, no GPU).

Enter: the actor's gradients and optimizer off, their blocks back to the driver -> the engine's weights
-> the sync -> the actor's parameters off, their blocks back to the driver -> the engine's KV cache.
Exit: the engine released, its blocks back to the driver -> the actor reloaded. ``torch.cuda.empty_cache``
runs only once CUDA is initialised.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from mcore_agentic.sharding import manager as manager_module
from mcore_agentic.sharding.config import ShardingConfig
from mcore_agentic.sharding.manager import NoEngine, ShardingManager
from mcore_agentic.sharding.transports import WeightVersion


class _Exporter:
    """Stands in for the streaming exporter: one bucket."""

    def __init__(self, bridge, chunks, *, bucket_bytes):
        del bridge, chunks, bucket_bytes

    def buckets(self):
        yield [("w", torch.zeros(2))]


class _Actor:
    def __init__(self, log: list[str]):
        self.log = log
        self.model = SimpleNamespace(chunks=[], bridge=None)

    def offload_before_export(self) -> int:
        self.log.append("actor.offload grads+optimizer")
        return 10

    def offload_after_export(self) -> int:
        self.log.append("actor.offload params")
        return 5

    def reload(self) -> int:
        self.log.append("actor.reload")
        return 15


class _Engine:
    def __init__(self, log: list[str], fail_sync: bool = False):
        self.log = log
        self.fail_sync = fail_sync
        self.weight_version = 0

    def resume_memory(self, tags=None) -> None:
        self.log.append(f"engine.resume {tags}")

    def update_weights(self, named_tensors, *, version: int) -> None:
        self.log.append("engine.update_weights")
        if self.fail_sync:
            raise ValueError("bad bucket")

    def finish_weight_update(self, version: int) -> None:
        self.log.append("engine.finish_weight_update")
        self.weight_version = version

    def release_memory(self) -> None:
        self.log.append("engine.release")

    def flush_cache(self) -> None: ...


@pytest.fixture
def log(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(manager_module, "StreamingExporter", _Exporter)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as on a GPU
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    return calls


def _manager(log: list[str], **engine_kw) -> ShardingManager:
    version = WeightVersion()
    version.bump()
    return ShardingManager(_Actor(log), _Engine(log, **engine_kw), ShardingConfig(), version=version)


def test_wake_order_around_a_rollout(log):
    manager = _manager(log)
    with manager:
        log.append("rollout")
    assert log == [
        "actor.offload grads+optimizer", "empty_cache",
        "engine.resume ['weights']",
        "engine.update_weights", "engine.finish_weight_update",
        "actor.offload params", "empty_cache",
        "engine.resume ['kv_cache']",
        "rollout",
        "engine.release", "empty_cache",
        "actor.reload",
    ]
    assert manager.offloaded_bytes == 15


def test_failed_sync_releases_returns_memory_and_reloads(log):
    with pytest.raises(ValueError, match="bad bucket"):
        with _manager(log, fail_sync=True):
            pass
    assert log == [
        "actor.offload grads+optimizer", "empty_cache",
        "engine.resume ['weights']",
        "engine.update_weights",
        "engine.release", "empty_cache",
        "actor.reload",
    ]


def test_no_empty_cache_before_cuda_is_initialised(log, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # CPU runs: never touch CUDA
    with _manager(log):
        pass
    assert "empty_cache" not in log and log[-1] == "actor.reload"


def test_no_engine_takes_tags():
    engine = NoEngine()
    engine.resume_memory(tags=["weights"])
    engine.resume_memory()


class _DrainingEngine(_Engine):
    """An engine with a request still generating: it refuses release until ``drain`` has aborted it."""

    def __init__(self, log: list[str]):
        super().__init__(log)
        self.live = 1

    def drain(self, timeout_s: float) -> bool:
        self.log.append(f"engine.drain {timeout_s:.0f}s")
        self.live = 0
        return True

    def release_memory(self) -> None:
        if self.live:
            raise RuntimeError(f"release_memory while {self.live} requests are generating")
        super().release_memory()


@pytest.mark.parametrize("error", [False, True])
def test_the_release_drains_what_still_generates(log, error):
    version = WeightVersion()
    version.bump()
    manager = ShardingManager(_Actor(log), _DrainingEngine(log), ShardingConfig(), version=version)
    with pytest.raises(ValueError, match="the rollout's own error") if error else contextlib.nullcontext():
        with manager:
            log.append("rollout")
            if error:
                raise ValueError("the rollout's own error")  # not release's refusal
    assert log[log.index("rollout") + 1:] == ["engine.drain 30s", "engine.release", "empty_cache", "actor.reload"]
