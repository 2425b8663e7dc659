"""GpuMetrics: NVML is off on a CPU machine (one debug line), and the collector turns readings into per-step metrics."""

from __future__ import annotations

import logging

import pynvml
import pytest
import torch

from mcore_agentic.utils.gpu_metrics import GpuMetrics, GpuReading, gpu_metrics_for, open_nvml

LOGGER = "mcore_agentic.utils.gpu_metrics"
GIB = 2**30


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def _scripted(readings: list[GpuReading]):
    """A reader returning ``readings`` one after the other."""
    it = iter(readings)
    return lambda: next(it)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_open_nvml_off_on_cpu_with_one_debug_line(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    assert open_nvml() is None
    records = _records(caplog)
    assert len(records) == 1
    assert records[0].levelno == logging.DEBUG
    assert records[0].getMessage().startswith("GPU metrics off: ")
    assert "NVML" in records[0].getMessage() or "CUDA" in records[0].getMessage()


def test_cpu_collector_is_disabled_noop(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    gpu = gpu_metrics_for("cpu")
    assert [r.getMessage() for r in _records(caplog)] == ["GPU metrics off: training on CPU"]
    assert not gpu.enabled
    assert gpu.read() is None
    gpu.phase_end("rollout")
    gpu.freed("engine_release", GpuReading(2 * GIB, 8 * GIB, 1.0), GpuReading(GIB, 8 * GIB, 1.0))
    with gpu.measure_freed("actor_offload"):
        pass
    assert gpu.pop() == {}
    assert len(_records(caplog)) == 1


def test_phase_metrics_max_memory_mean_utilisation_and_pop_clears():
    total = 80 * GIB
    gpu = GpuMetrics(
        _scripted(
            [
                GpuReading(10 * GIB, total, 50.0),  # rollout
                GpuReading(30 * GIB, total, 90.0),  # train
                GpuReading(20 * GIB, total, 70.0),  # train again: max memory, mean utilisation
                GpuReading(5 * GIB, total, 10.0),  # next step
            ]
        )
    )
    assert gpu.enabled
    gpu.phase_end("rollout")
    gpu.phase_end("train")
    gpu.phase_end("train")
    assert gpu.pop() == {
        "gpu/memory_used_gb/rollout": 10.0,
        "gpu/utilization/rollout": 50.0,
        "gpu/memory_used_gb/train": 30.0,
        "gpu/utilization/train": 80.0,
        "gpu/memory_total_gb": 80.0,
    }
    assert gpu.pop() == {}
    gpu.phase_end("rollout")
    assert gpu.pop() == {
        "gpu/memory_used_gb/rollout": 5.0,
        "gpu/utilization/rollout": 10.0,
        "gpu/memory_total_gb": 80.0,
    }


def test_freed_and_measure_freed():
    total = 80 * GIB
    gpu = GpuMetrics(
        _scripted(
            [
                GpuReading(40 * GIB, total, 0.0),  # before engine release
                GpuReading(10 * GIB, total, 0.0),  # after
                GpuReading(10 * GIB, total, 0.0),  # before actor offload
                GpuReading(10 * GIB + GIB // 2, total, 0.0),  # after: usage grew
            ]
        )
    )
    with gpu.measure_freed("engine_release"):
        pass
    before, after = gpu.read(), gpu.read()
    gpu.freed("actor_offload", before, after)
    gpu.freed("ignored", None, after)
    assert gpu.pop() == {"gpu/freed_gb/engine_release": 30.0, "gpu/freed_gb/actor_offload": -0.5}
    assert gpu.pop() == {}


def test_nvml_error_disables_collector_with_one_debug_line(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    calls = []

    def lost_gpu() -> GpuReading:
        calls.append(1)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    gpu = GpuMetrics(lost_gpu)
    gpu.phase_end("rollout")
    assert not gpu.enabled
    gpu.phase_end("train")
    with gpu.measure_freed("engine_release"):
        pass
    assert gpu.read() is None
    assert gpu.pop() == {}
    assert len(calls) == 1
    messages = [r.getMessage() for r in _records(caplog)]
    assert len(messages) == 1
    assert messages[0].startswith("GPU metrics off: ") and "GPU is lost" in messages[0]


def test_phase_timer_reads_the_device_when_each_phase_ends():
    from mcore_agentic.utils.timing import PhaseTimer

    gpu = GpuMetrics(_scripted([GpuReading(3 * GIB, 8 * GIB, 40.0), GpuReading(5 * GIB, 8 * GIB, 60.0)]))
    timer = PhaseTimer(sync=False, on_end=gpu.phase_end)
    with timer.phase("gen"):
        pass
    with timer.phase("update_actor"):
        pass
    assert set(timer.pop()) == {"timing_s/gen", "timing_s/update_actor"}
    metrics = gpu.pop()
    assert metrics["gpu/memory_used_gb/gen"] == pytest.approx(3.0)
    assert metrics["gpu/memory_used_gb/update_actor"] == pytest.approx(5.0)
    assert metrics["gpu/utilization/update_actor"] == pytest.approx(60.0)
