"""GPU memory and utilisation per training phase, read through NVML.

``torch.cuda.memory_allocated`` only sees torch's caching allocator; a colocated rollout
engine (vLLM, SGLang) holds its weights and KV cache outside it. NVML reports what the
device itself has in use, so these metrics show whether the engine's release (sleep) and
the actor's offload really give memory back::

    gpu = gpu_metrics_for(cfg.trainer.device)
    with gpu.measure_freed("engine_release"):
        engine.release_memory()
    gpu.phase_end("rollout")
    metrics.update(gpu.pop())

Metric names (one step's values, cleared by :meth:`GpuMetrics.pop`):

- ``gpu/memory_used_gb/<phase>``: device memory in use at the end of the phase, GiB
  (the max when the phase repeats within a step);
- ``gpu/utilization/<phase>``: GPU utilisation percent over NVML's last sample period
  (about 1/6 s to 1 s, depending on the device), at the end of the phase (the mean when
  the phase repeats);
- ``gpu/memory_total_gb``: the device's memory, GiB;
- ``gpu/freed_gb/<name>``: memory in use before minus after a release, GiB (negative
  when usage grew).

NVML comes from the ``pynvml`` module of the PyPI package ``nvidia-ml-py``, imported only
when :func:`open_nvml` runs. Without it, without the NVML library (CPU machines) or
without a CUDA device, the collector is disabled: every call is a no-op, ``pop()``
returns ``{}`` and one debug line says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_GIB = float(2**30)


@dataclass(frozen=True)
class GpuReading:
    """One NVML sample of a device.

    ``used_bytes`` / ``total_bytes``: device memory as NVML reports it, i.e. including
    memory held outside torch's allocator (a vLLM/SGLang engine, the CUDA context).
    ``utilization_percent``: percent of NVML's last sample period in which a kernel ran.
    """

    used_bytes: int
    total_bytes: int
    utilization_percent: float


def _nvml_error_types() -> tuple[type[BaseException], ...]:
    """``(pynvml.NVMLError,)``, or ``()`` (catches nothing) when pynvml is not importable."""
    try:
        import pynvml
    except ImportError:
        return ()
    return (pynvml.NVMLError,)


def _handle_for_torch_device(pynvml: Any, index: int) -> Any:
    """NVML handle of torch CUDA device ``index``.

    torch numbers the devices visible to the process (after ``CUDA_VISIBLE_DEVICES`` and
    ``CUDA_DEVICE_ORDER``); NVML numbers all of them by PCI bus. The PCI address links the
    two; builds of torch without it fall back to the bare index.
    """
    try:
        props = torch.cuda.get_device_properties(index)
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception:  # no PCI fields, CPU-only torch, NVML refusing the address
        return pynvml.nvmlDeviceGetHandleByIndex(index)


def _shutdown(pynvml: Any) -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


def open_nvml(device_index: int | None = None) -> Callable[[], GpuReading] | None:
    """A zero-argument reader of torch CUDA device ``device_index``, or None when NVML cannot serve.

    ``device_index`` None: torch's current CUDA device; None is returned when torch has no
    CUDA. Never raises: when pynvml is not importable, the NVML library is missing or fails,
    or there is no CUDA device, returns None after one debug line saying why. The reader
    itself raises ``pynvml.NVMLError`` when a later query fails (:class:`GpuMetrics` then
    stops sampling).
    """
    try:
        import pynvml
    except ImportError as exc:
        logger.debug("GPU metrics off: pynvml not importable (%s); install nvidia-ml-py", exc)
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError, e.g. NVML Shared Library Not Found
        logger.debug("GPU metrics off: NVML unavailable (%s)", exc)
        return None
    try:
        if device_index is None:
            if not torch.cuda.is_available():
                _shutdown(pynvml)
                logger.debug("GPU metrics off: torch sees no CUDA device")
                return None
            device_index = torch.cuda.current_device()
        handle = _handle_for_torch_device(pynvml, device_index)
    except Exception as exc:  # pynvml.NVMLError, or torch's CUDA initialisation failing
        _shutdown(pynvml)
        logger.debug("GPU metrics off: no NVML handle for CUDA device %s (%s)", device_index, exc)
        return None

    def read() -> GpuReading:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return GpuReading(
            used_bytes=int(memory.used), total_bytes=int(memory.total), utilization_percent=float(rates.gpu)
        )

    return read


class GpuMetrics:
    """Per-step GPU metrics from a reader (see :func:`open_nvml`); disabled when the reader is None.

    ``phase_end(name)`` samples at the end of each phase, ``freed`` / ``measure_freed``
    record what a release gave back, ``pop()`` returns the step's metrics and clears them.
    A reader that raises ``pynvml.NVMLError`` disables the collector (one debug line).
    """

    def __init__(self, reader: Callable[[], GpuReading] | None) -> None:
        self._reader = reader
        self._memory_used_gb: dict[str, float] = {}
        self._utilization: dict[str, list[float]] = {}  # phase -> [sum, count]
        self._memory_total_gb: float | None = None
        self._freed_gb: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        """Whether readings are taken (False without NVML, or after a failed reading)."""
        return self._reader is not None

    def read(self) -> GpuReading | None:
        """A reading now; None when disabled (or when this reading failed and disabled the collector)."""
        if self._reader is None:
            return None
        try:
            return self._reader()
        except _nvml_error_types() as exc:
            self._reader = None
            logger.debug("GPU metrics off: NVML reading failed (%s)", exc)
            return None

    def phase_end(self, phase: str) -> None:
        """Record memory in use and utilisation at the end of ``phase``.

        A phase repeated before :meth:`pop` keeps its max memory and mean utilisation.
        """
        reading = self.read()
        if reading is None:
            return
        used_gb = reading.used_bytes / _GIB
        self._memory_used_gb[phase] = max(used_gb, self._memory_used_gb.get(phase, used_gb))
        acc = self._utilization.setdefault(phase, [0.0, 0.0])
        acc[0] += reading.utilization_percent
        acc[1] += 1.0
        if self._memory_total_gb is None:
            self._memory_total_gb = reading.total_bytes / _GIB

    def freed(self, name: str, before: GpuReading | None, after: GpuReading | None) -> None:
        """Record ``gpu/freed_gb/<name>`` = (before.used - after.used) GiB; nothing when either is None.

        Repeated before :meth:`pop`, the amounts add up.
        """
        if self._reader is None or before is None or after is None:
            return
        gb = (before.used_bytes - after.used_bytes) / _GIB
        self._freed_gb[name] = self._freed_gb.get(name, 0.0) + gb

    @contextmanager
    def measure_freed(self, name: str) -> Iterator[None]:
        """Read before and after the block and record the difference as ``gpu/freed_gb/<name>``.

        Nothing is recorded when the block raises.
        """
        before = self.read()
        yield
        self.freed(name, before, self.read())

    def pop(self) -> dict[str, float]:
        """The metrics gathered since the last pop (``{}`` when disabled); clears them."""
        out: dict[str, float] = {}
        for phase, gb in self._memory_used_gb.items():
            out[f"gpu/memory_used_gb/{phase}"] = gb
        for phase, (total, count) in self._utilization.items():
            out[f"gpu/utilization/{phase}"] = total / count
        if self._memory_total_gb is not None:
            out["gpu/memory_total_gb"] = self._memory_total_gb
        for name, gb in self._freed_gb.items():
            out[f"gpu/freed_gb/{name}"] = gb
        self._memory_used_gb = {}
        self._utilization = {}
        self._memory_total_gb = None
        self._freed_gb = {}
        return out


def gpu_metrics_for(device: str) -> GpuMetrics:
    """The collector for ``trainer.device``: NVML on ``cuda`` (``cuda:<i>``, or ``auto`` with CUDA), else disabled."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return GpuMetrics(open_nvml())
    if device.startswith("cuda:") and device[len("cuda:") :].isdigit():
        return GpuMetrics(open_nvml(int(device[len("cuda:") :])))
    logger.debug("GPU metrics off: training on CPU")
    return GpuMetrics(None)
