"""``timing_s/sharding/*`` include the device work each phase queued (GPU review m4), no GPU.

On a GPU the offload's device-to-host copies, the reload's host-to-device copies and an in-process engine's load
kernels are queued, and a phase that returns has not finished them. A stand-in device queues the work each
stand-in call asks for and waits for it only in ``synchronize`` (the timer's synchronisation hook,
:func:`mcore_agentic.utils.timing._cuda_sync`): a phase's time holds its work only if the phase synchronises.
"""

from __future__ import annotations

import time

import pytest
import torch

from mcore_agentic.sharding import manager as manager_module
from mcore_agentic.sharding.config import ShardingConfig
from mcore_agentic.sharding.manager import ShardingManager
from mcore_agentic.sharding.transports import WeightVersion
from mcore_agentic.utils import timing
from tests.unit.sharding.test_manager_order import _Actor, _Engine, _Exporter

WORK = 0.05
"""Seconds of device work each stand-in call queues."""


class _Device:
    """A device queue: work queued by calls, waited for by ``synchronize`` alone."""

    def __init__(self) -> None:
        self.pending = 0.0
        self.synchronizations = 0

    def queue(self) -> None:
        self.pending += WORK

    def synchronize(self) -> None:
        self.synchronizations += 1
        time.sleep(self.pending)
        self.pending = 0.0


class _QueuingActor(_Actor):
    def __init__(self, device: _Device) -> None:
        super().__init__(log=[])
        self.device = device

    def offload_before_export(self) -> int:
        self.device.queue()
        return super().offload_before_export()

    def offload_after_export(self) -> int:
        self.device.queue()
        return super().offload_after_export()

    def reload(self) -> int:
        self.device.queue()
        return super().reload()


class _QueuingEngine(_Engine):
    def __init__(self, device: _Device) -> None:
        super().__init__(log=[])
        self.device = device

    def resume_memory(self, tags=None) -> None:
        self.device.queue()
        super().resume_memory(tags)

    def update_weights(self, named_tensors, *, version: int) -> None:
        self.device.queue()
        super().update_weights(named_tensors, version=version)

    def release_memory(self) -> None:
        self.device.queue()
        super().release_memory()


@pytest.fixture
def device(monkeypatch) -> _Device:
    queue = _Device()
    monkeypatch.setattr(manager_module, "StreamingExporter", _Exporter)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(timing, "_cuda_sync", queue.synchronize)
    return queue


def _roll_out(device: _Device) -> ShardingManager:
    version = WeightVersion()
    version.bump()
    manager = ShardingManager(_QueuingActor(device), _QueuingEngine(device), ShardingConfig(), version=version)
    with manager:
        pass
    return manager


def test_phase_times_hold_the_device_work_they_queued(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the models are on the device
    times = _roll_out(device).metrics()
    queued = {"offload": 2 * WORK, "resume": 2 * WORK, "sync": WORK, "release": WORK, "reload": WORK}
    short = {k: times[f"timing_s/sharding/{k}"] for k, v in queued.items() if times[f"timing_s/sharding/{k}"] < v}
    assert short == {}, f"phases shorter than the device work they queued ({queued}): {short}"
    assert device.pending == 0.0


def test_no_synchronisation_before_cuda_is_initialised(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # CPU runs: never touch CUDA
    _roll_out(device)
    assert device.synchronizations == 0
