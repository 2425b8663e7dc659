"""The placements of a job's GPUs, ranked (``python -m mcore_agentic.plan --placements``): colocated, and each split
between trainer and rollout ranks that the run's rules allow (``rollout.placement=separate``).

Each candidate is planned exactly as the run would be (:func:`~.plan.make_plan`): under separate placement the
trainer's GPUs hold no engine and the step is the slower of generation (on the rollout ranks' engines) and
training (on the rest) plus the weight transfer; colocated, their sum. Offloads around the rollout, which separate
placement refuses, are off in its candidates. The fastest that fits comes first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mcore_agentic.plan.census import run_census
from mcore_agentic.plan.devices import Device
from mcore_agentic.utils.errors import ConfigError


@dataclass(frozen=True)
class PlacementOption:
    overrides: list[str]
    rollout_ranks: int
    """0: colocated."""
    total_seconds: float
    generation_seconds: float
    training_seconds: float
    peak_bytes: int
    fits: bool


def candidates(cfg: Any, world_size: int) -> list[Any]:
    """The run colocated, then separate with each number of rollout ranks its rules allow on ``world_size`` GPUs."""
    from mcore_agentic.config.rules import validate

    r = cfg.rollout
    colocated = dataclasses.replace(cfg, rollout=dataclasses.replace(r, placement="colocated", rollout_ranks=0))
    out = [colocated]
    actor = dataclasses.replace(cfg.actor, param_offload=False, grad_offload=False, optimizer_offload=False)
    partial = dataclasses.replace(r.partial_rollout, max_staleness=None)
    for ranks in range(r.tensor_model_parallel_size, world_size, r.tensor_model_parallel_size):
        try:
            run = dataclasses.replace(cfg, actor=actor, rollout=dataclasses.replace(
                r, placement="separate", rollout_ranks=ranks, partial_rollout=partial))
            validate(run, world_size)
        except ConfigError:
            continue  # the trainer's layout, the batch or the engines do not split this way
        out.append(run)
    return out


def placements(cfg: Any, hf_config: Any, device: Device, world_size: int, *, teacher_hf_config: Any = None,
               headroom: float = 0.05, mfu: float | None = None, mean_length: int | None = None) -> list[PlacementOption]:
    """Every candidate's plan, the fastest that fits first."""
    from mcore_agentic.plan.plan import MFU, census_requests, make_plan

    runs = candidates(cfg, world_size)
    requests = []
    for run in runs:
        trainers = world_size - run.rollout.rollout_ranks
        requests += census_requests(run, run.actor.parallel, hf_config, teacher_hf_config, trainers)
    run_census(requests)  # one child call answers every candidate; make_plan then finds them in memory
    out = []
    for run in runs:
        plan = make_plan(run, hf_config, device, world_size, teacher_hf_config=teacher_hf_config, headroom=headroom,
                         mfu=mfu or MFU, mean_length=mean_length)
        generation = sum(v for k, v in plan.step_seconds.items() if k.startswith("rollout "))
        ranks = run.rollout.rollout_ranks
        overrides = ([f"rollout.placement=separate rollout.rollout_ranks={ranks}"] if ranks
                     else ["rollout.placement=colocated"])
        out.append(PlacementOption(overrides, ranks, plan.total_seconds, generation,
                                   sum(plan.step_seconds.values()) - generation, plan.peak.bytes, plan.fits))
    out.sort(key=lambda o: (not o.fits, round(o.total_seconds, 3), o.rollout_ranks))
    return out


__all__ = ["PlacementOption", "candidates", "placements"]
