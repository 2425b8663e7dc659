"""The plan of a composed config, and the launcher's check (``trainer.plan_check``) before any model is built."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from mcore_agentic.plan.devices import DEVICES, GIB, Device, get_device
from mcore_agentic.utils.errors import ConfigError


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


def local_gpu() -> Device | None:
    """This machine's GPU as a :class:`Device` (its memory from ``nvidia-smi``, which creates no CUDA context; the
    bandwidths of the closest known device), or None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.strip().splitlines()[0] if out.strip() else ""
    if "," not in line:
        return None
    name, mib = line.rsplit(",", 1)
    known = "b200" if "B200" in name else ("h200-141g" if "H200" in name else "h100-80g")
    base = DEVICES[known]
    return Device(f"{name.strip()} (as {known})", float(mib) / 1024, base.hbm_tb_s, base.bf16_tflops,
                  base.intra_node_gb_s, base.inter_node_gb_s)


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
