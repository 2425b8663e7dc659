"""The plan of a composed config, and the launcher's check (``trainer.plan_check``) before any model is built."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from mcore_agentic.plan.devices import DEVICES, GIB, Device, get_device
from mcore_agentic.utils.errors import ConfigError

_log = logging.getLogger(__name__)
_FALLBACK = "h100-80g"
"""The bandwidths and throughput a GPU the planner does not know is planned with (said in its name and a warning)."""


def plan_for(cfg: Any, *, device: str | Device = "h100-80g", memory_gib: float | None = None, world_size: int,
             headroom: float = 0.05, mfu: float | None = None, mean_length: int | None = None) -> Any:
    """The :class:`~mcore_agentic.plan.plan.Plan` of a composed ``RLConfig`` on ``world_size`` GPUs."""
    from mcore_agentic.plan.known_models import resolve_hf_config
    from mcore_agentic.plan.plan import MFU, make_plan

    hf = resolve_hf_config(cfg.model.model_path)
    teacher = resolve_hf_config(cfg.teacher.model_path, "teacher.model_path") if cfg.teacher.model_path else None
    if isinstance(device, str):
        device = get_device(device, memory_gib=memory_gib)
    return make_plan(cfg, hf, device, world_size, teacher_hf_config=teacher, headroom=headroom, mfu=mfu or MFU,
                     mean_length=mean_length)


def suggestions_for(cfg: Any, *, device: str | Device = "h100-80g", memory_gib: float | None = None,
                    world_size: int, headroom: float = 0.05, mfu: float | None = None, limit: int = 3) -> list[Any]:
    """The ``limit`` fastest layouts and offload settings of ``cfg`` that fit (:mod:`.suggest`)."""
    from mcore_agentic.plan.known_models import resolve_hf_config
    from mcore_agentic.plan.suggest import suggest

    hf = resolve_hf_config(cfg.model.model_path)
    teacher = resolve_hf_config(cfg.teacher.model_path, "teacher.model_path") if cfg.teacher.model_path else None
    if isinstance(device, str):
        device = get_device(device, memory_gib=memory_gib)
    return suggest(cfg, hf, device, world_size, teacher_hf_config=teacher, headroom=headroom, mfu=mfu, limit=limit)


def placements_for(cfg: Any, *, device: str | Device = "h100-80g", memory_gib: float | None = None,
                   world_size: int, headroom: float = 0.05, mfu: float | None = None,
                   mean_length: int | None = None) -> list[Any]:
    """Colocated and each split of ``world_size`` GPUs between trainer and rollout ranks, ranked (:mod:`.placement`)."""
    from mcore_agentic.plan.known_models import resolve_hf_config
    from mcore_agentic.plan.placement import placements

    hf = resolve_hf_config(cfg.model.model_path)
    teacher = resolve_hf_config(cfg.teacher.model_path, "teacher.model_path") if cfg.teacher.model_path else None
    if isinstance(device, str):
        device = get_device(device, memory_gib=memory_gib)
    return placements(cfg, hf, device, world_size, teacher_hf_config=teacher, headroom=headroom, mfu=mfu,
                      mean_length=mean_length)


@dataclass(frozen=True)
class VisibleGpu:
    """The GPU (or MIG slice) CUDA's device 0 is, as ``nvidia-smi -L`` lists it."""

    index: int
    """nvidia-smi's index of the GPU (of the MIG slice's GPU)."""
    name: str
    mig_index: int | None = None
    """The slice's ``Device N`` on its GPU; None for a whole GPU."""
    mig_profile: str | None = None
    """The slice's profile (``3g.40gb``)."""


_GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[^)]+)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)\s*$")


def visible_gpu(listing: str, cuda_visible_devices: str | None) -> VisibleGpu | None:
    """CUDA's device 0 in ``nvidia-smi -L``'s ``listing``: the first entry of ``cuda_visible_devices`` (an index,
    or a ``GPU-``/``MIG-`` UUID or a prefix of one, as CUDA takes them; unset: the first GPU), or None when nothing is
    visible or the entry names no listed device. A GPU in MIG mode is its first slice. (An index is nvidia-smi's, the
    PCI bus order, which is CUDA's under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.)"""
    gpus: list[tuple[VisibleGpu, str, list[tuple[VisibleGpu, str]]]] = []
    for line in listing.splitlines():
        if (g := _GPU_LINE.match(line)) is not None:
            gpus.append((VisibleGpu(int(g[1]), g[2].strip()), g[3], []))
        elif (m := _MIG_LINE.match(line)) is not None and gpus:
            gpu = gpus[-1][0]
            gpus[-1][2].append((VisibleGpu(gpu.index, gpu.name, int(m[2]), m[1]), m[3]))
    first = "0" if cuda_visible_devices is None else cuda_visible_devices.split(",")[0].strip()
    for gpu, uuid, migs in gpus:
        if (first.isdigit() and int(first) == gpu.index) or (first.startswith("GPU-") and uuid.startswith(first)):
            return migs[0][0] if migs else gpu
        for mig, mig_uuid in migs:
            if first.startswith("MIG-") and mig_uuid.startswith(first):
                return mig
    return None


def mig_memory_mib(query: str, mig_index: int) -> float | None:
    """The ``FB Memory Usage`` total (MiB) of MIG device ``mig_index`` in ``nvidia-smi --id=N -q``'s ``query`` of its
    GPU; None when the listing has no such device (or no memory for it)."""
    lines = query.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "MIG Devices")
    except StopIteration:
        return None
    depth = len(lines[start]) - len(lines[start].lstrip())
    index, in_fb = None, False
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= depth:  # the section ends: the GPU's own fields
            break
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "MIG Device":
            index, in_fb = None, False
        elif key == "Index" and value.isdigit():
            index = int(value)
        elif key.endswith("Memory Usage"):
            in_fb = key == "FB Memory Usage"
        elif key == "Total" and in_fb and index == mig_index and value.endswith("MiB"):
            return float(value.removesuffix("MiB"))
    return None


def known_kind(name: str) -> str | None:
    """The planner's device (:data:`~mcore_agentic.plan.devices.DEVICES`) an ``nvidia-smi`` GPU name is, or None for
    any other GPU: an H100 SXM reports itself as ``NVIDIA H100 80GB HBM3`` (not an H100 PCIe or NVL, whose memory
    bandwidth and throughput are lower, nor an H800 or H20), an H200 SXM as ``NVIDIA H200`` (not the H200 NVL), a B200
    as ``NVIDIA B200`` (not a GB200's)."""
    variant = re.search(r"\b(PCIe|NVL)\b", name, re.IGNORECASE) is not None
    if re.search(r"\bB200\b", name) and not variant:
        return "b200"
    if re.search(r"\bH200\b", name) and not variant:
        return "h200-141g"
    if re.search(r"\bH100\b", name) and re.search(r"\b(HBM3|SXM\d?)\b", name) and not variant:
        return "h100-80g"
    return None


def gpu_device(name: str, memory_mib: float, mig_profile: str | None = None) -> tuple[Device, list[str]]:
    """The :class:`Device` of a GPU ``nvidia-smi`` names, with ``memory_mib`` (a MIG slice's, with its
    ``mig_profile``), and what the plan should be warned of: a GPU the planner does not know takes the H100 SXM's
    bandwidths and throughput, and says so in its name; a MIG slice keeps its whole GPU's."""
    kind = known_kind(name)
    what = f"as {kind}" if kind else f"not known to the planner: {_FALLBACK}'s bandwidths"
    label = f"{name} ({what})" if mig_profile is None else f"{name} MIG {mig_profile} ({what})"
    notes = [] if kind else [
        f"{name} is not a GPU the planner knows ({', '.join(DEVICES)}): its memory is read, its bandwidths and "
        f"throughput are taken as {_FALLBACK}'s, so the step-time terms are not its own"]
    if mig_profile is not None:
        notes.append(f"MIG {mig_profile} of {name}: its own memory, its whole GPU's bandwidths and throughput")
    base = DEVICES[kind or _FALLBACK]
    return (Device(label, memory_mib / 1024, base.hbm_tb_s, base.bf16_tflops, base.intra_node_gb_s,
                   base.inter_node_gb_s), notes)


def _smi(smi: str, *args: str) -> str | None:
    try:
        return subprocess.run([smi, *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def local_gpu() -> Device | None:
    """CUDA's first visible GPU here (``CUDA_VISIBLE_DEVICES``' first entry, a MIG slice included) as a
    :class:`Device`: its memory from ``nvidia-smi``, which creates no CUDA context, and the bandwidths of the known
    device it is (:func:`gpu_device`, which says when it is none). A MIG slice's memory is its own (``nvidia-smi -q``),
    else its profile's nominal size (``3g.40gb``: 40 GiB), with a warning. None without a GPU, or when the visible one
    or its memory cannot be read (said in a warning: the plan check is then skipped)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listing = _smi(smi, "-L")
    gpu = visible_gpu(listing or "", visible)
    if gpu is None:
        if listing and (visible is None or visible.split(",")[0].strip()):
            which = "the first GPU" if visible is None else f"CUDA_VISIBLE_DEVICES={visible}'s first device"
            _log.warning("plan: nvidia-smi -L lists no %s: the plan check is skipped", which)
        return None
    out = _smi(smi, f"--id={gpu.index}", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits")
    line = out.strip().splitlines()[0] if out and out.strip() else ""
    name, _, mib = line.rpartition(",")
    try:
        memory_mib = float(mib)
    except ValueError:
        _log.warning("plan: nvidia-smi --id=%d gave no memory (%r): the plan check is skipped", gpu.index, line)
        return None
    if gpu.mig_index is not None:
        slice_mib = mig_memory_mib(_smi(smi, f"--id={gpu.index}", "-q") or "", gpu.mig_index)
        nominal = re.fullmatch(r"\d+g\.(\d+)gb", gpu.mig_profile or "")
        if slice_mib is None and nominal is None:
            _log.warning("plan: the memory of MIG %s (device %d of GPU %d) could not be read from nvidia-smi -q: "
                         "the plan check is skipped (its GPU's %.0f MiB would overstate it)", gpu.mig_profile,
                         gpu.mig_index, gpu.index, memory_mib)
            return None
        if slice_mib is None and nominal is not None:
            slice_mib = float(nominal[1]) * 1024
            _log.warning("plan: the memory of MIG %s (device %d of GPU %d) could not be read from nvidia-smi -q: "
                         "planned with its profile's nominal %s GiB, a little more than it has", gpu.mig_profile,
                         gpu.mig_index, gpu.index, nominal[1])
        memory_mib = slice_mib
    device, notes = gpu_device(name.strip() or gpu.name, memory_mib, gpu.mig_profile)
    for note in notes:
        _log.warning("plan: %s", note)
    return device


def launch_check(cfg: Any, world_size: int, device: Device | None) -> tuple[str | None, ConfigError | None]:
    """``trainer.plan_check`` before the workers start: (a line to print, or an error to refuse the run with).

    ``off``, a CPU run (``trainer.device=cpu``) or no GPU here: nothing. ``warn``: a line either way.
    ``error``: a run that does not fit is refused in one line naming the phase, the rank and the shortfall."""
    mode = cfg.trainer.plan_check
    if mode == "off" or device is None or cfg.trainer.device == "cpu":
        return None, None
    from mcore_agentic.plan.census import shutdown_census

    try:
        plan = plan_for(cfg, device=device, world_size=world_size)
    finally:  # the run asks nothing more: the child would hold its host memory on every rank for the whole run
        shutdown_census()
    peak = plan.peak
    usable = plan.capacity_bytes * (1 - plan.headroom)
    if plan.fits:
        return (f"plan: fits; the peak is {peak.name} at {peak.bytes / GIB:.1f} GiB of {usable / GIB:.1f} usable on "
                f"each {device.name} (python -m mcore_agentic.plan for the breakdown)"), None
    if peak.bytes <= usable:  # it fits but for the engine's KV cache
        message = plan.engine.problem
        if mode == "error":
            return None, ConfigError("rollout.gpu_memory_utilization", message)
        return f"plan: WARNING, {message}", None
    message = (f"{peak.name} needs {peak.bytes / GIB:.1f} GiB on rank {peak.rank} but {device.name} has "
               f"{usable / GIB:.1f} usable: {(peak.bytes - usable) / GIB:.1f} GiB short (python -m mcore_agentic.plan "
               "with the same overrides shows each part; offload keys, a smaller micro-batch or more model "
               "parallelism lower it; trainer.plan_check=warn runs anyway)")
    if mode == "error":
        return None, ConfigError("trainer.plan_check", message)
    return f"plan: WARNING, {message}", None
