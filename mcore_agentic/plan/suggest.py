"""Layouts and offload settings that fit, ranked by estimated step time (``python -m mcore_agentic.plan --suggest``).

Candidates vary what the planner can change without changing the run's meaning: the actor's TP (with sequence
parallelism above 1), PP, EP for a mixture of experts, activation recomputation (the run's own, or full), the offload
keys (none; the optimizer; the host optimizer; parameters, gradients and optimizer) and the micro-batches (the actor's and reference's, halved until they fit: the same
mini-batches, accumulated over more micro-batches). Batch sizes, lengths and the engine's settings stay the user's. Each candidate is planned
exactly as the configured run is (the census answers every layout in one child process); a layout is offered
with the least offload that makes it fit, which costs its host transfers in the step time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.plan.census import run_census
from mcore_agentic.plan.devices import Device

OFFLOADS: dict[str, dict[str, bool]] = {
    "none": dict(param_offload=False, grad_offload=False, optimizer_offload=False),
    "optimizer": dict(param_offload=False, grad_offload=False, optimizer_offload=True),
    "host optimizer": dict(param_offload=False, grad_offload=False, optimizer_offload=False, host_optimizer=True),
    "all": dict(param_offload=True, grad_offload=True, optimizer_offload=True),
    "all, host optimizer": dict(param_offload=True, grad_offload=True, optimizer_offload=False, host_optimizer=True),
}
"""Offload settings in the order they are tried (the least that fits wins). ``optimizer``/``all`` move state off the
GPU for the rollout only; ``host_optimizer`` (``actor.optim.optimizer_cpu_offload``) keeps the fp32 masters and Adam
moments on the host for good, the update included, at the cost of a host Adam step (bf16/fp16 models with the
distributed optimizer only)."""


AROUND_ROLLOUT = ("param_offload", "grad_offload", "optimizer_offload")
"""The offloads around the rollout (not candidates under separate placement, which refuses them)."""


def _offloaded(actor: Any, keys: dict[str, bool], model_dtype: str) -> Any:
    """``actor`` with the offload ``keys``; None where they cannot apply (a host optimizer for an fp32 model or
    without the distributed optimizer)."""
    keys = dict(keys)
    host = keys.pop("host_optimizer", False)
    if host and (model_dtype not in ("bfloat16", "float16") or not actor.use_distributed_optimizer):
        return None
    # Each candidate says where the optimizer lives (a run's own host optimizer is the "host optimizer" candidate).
    optim = dataclasses.replace(actor.optim, optimizer_cpu_offload=host,
                                optimizer_offload_fraction=1.0 if host else actor.optim.optimizer_offload_fraction)
    return dataclasses.replace(actor, optim=optim, **keys)


@dataclass(frozen=True)
class Suggestion:
    overrides: list[str]
    model_parallel: int
    """TP x PP x EP: the ranks one copy of the model spreads over (smaller is simpler)."""
    peak_bytes: int
    step_seconds: float


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= limit and n % d == 0]


def candidate_layouts(hf_config: Any, world_size: int, base: ParallelConfig) -> list[ParallelConfig]:
    """Every (TP, PP, EP) the model and the world allow (TP within a node of 8, dividing the query and KV heads;
    PP dividing the layers; EP dividing the experts and the ranks outside TP x PP); CP and VPP as configured."""
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    out = []
    for tp in _divisors(heads, 8):
        if kv % tp and tp % kv:
            continue
        for pp in _divisors(hf_config.num_hidden_layers, world_size // tp):
            if world_size % (tp * pp * base.context_parallel_size):
                continue
            rest = world_size // (tp * pp)
            for ep in (_divisors(experts, rest) if experts else [1]):
                if (rest * tp) % ep:
                    continue
                vpp = base.virtual_pipeline_model_parallel_size if pp > 1 else None
                if vpp and hf_config.num_hidden_layers % (pp * vpp):
                    vpp = None
                out.append(dataclasses.replace(base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                               expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                                               virtual_pipeline_model_parallel_size=vpp))
    return out


def _smaller_micro_batches(cfg: Any, shrink: int) -> dict[str, dict[str, int]] | None:
    """The actor's and reference's micro-batch keys divided by ``shrink`` (a token budget stays >= one longest
    sequence, a row count >= 1); None when ``shrink`` cannot make them smaller than ``shrink / 2`` did."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    out: dict[str, dict[str, int]] = {}
    smaller = shrink == 1
    for group, conf, rows_key, tokens_key in (
            ("actor", cfg.actor, "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"),
            ("ref", cfg.ref, "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu")):
        if conf.use_dynamic_bsz:
            value, floor, key = getattr(conf, tokens_key), longest, tokens_key
        else:
            value, floor, key = getattr(conf, rows_key), 1, rows_key
        new = max(value // shrink, floor)
        smaller = smaller or new < max(value // max(shrink // 2, 1), floor)
        out[group] = {key: new} if shrink > 1 else {}
    return out if smaller else None


def suggest(cfg: Any, hf_config: Any, device: Device, world_size: int, *, teacher_hf_config: Any = None,
            headroom: float = 0.05, mfu: float | None = None, limit: int = 5) -> list[Suggestion]:
    """The fastest ``limit`` candidates that fit, fastest first."""
    from mcore_agentic.plan.plan import MFU, census_requests, make_plan

    trainers = world_size - cfg.rollout.rollout_ranks if cfg.rollout.separate else world_size
    layouts = candidate_layouts(hf_config, trainers, cfg.actor.parallel)
    # One child call answers every layout's census up front; make_plan then finds them in memory.
    run_census([r for par in layouts for r in census_requests(cfg, par, hf_config, teacher_hf_config, trainers)])
    found = []
    for par in layouts:
        for recompute in _recompute_options(cfg.actor.recompute):
            for shrink in (1, 2, 4, 8, 16):
                batching = _smaller_micro_batches(cfg, shrink)
                if batching is None:
                    break
                for keys in OFFLOADS.values():
                    if cfg.rollout.separate and any(keys.get(k) for k in AROUND_ROLLOUT):
                        continue  # nothing to offload around a rollout that runs on other ranks
                    offloaded = _offloaded(cfg.actor, keys, cfg.model.dtype)
                    if offloaded is None:
                        continue
                    actor = dataclasses.replace(offloaded, parallel=par, recompute=recompute, **batching["actor"])
                    run = dataclasses.replace(cfg, actor=actor, ref=dataclasses.replace(cfg.ref, **batching["ref"]))
                    plan = make_plan(run, hf_config, device, world_size, teacher_hf_config=teacher_hf_config,
                                     headroom=headroom, mfu=mfu or MFU)
                    if not plan.fits:
                        continue  # try more offload
                    overrides = [f"actor.tensor_model_parallel_size={par.tensor_model_parallel_size}",
                                 f"actor.pipeline_model_parallel_size={par.pipeline_model_parallel_size}"]
                    if par.expert_model_parallel_size > 1 or getattr(hf_config, "num_experts", 0):
                        overrides.append(f"actor.expert_model_parallel_size={par.expert_model_parallel_size}")
                    if par.sequence_parallel:
                        overrides.append("actor.sequence_parallel=true")
                    if recompute != cfg.actor.recompute:  # full, one uniform layer per unit: the keys' defaults
                        overrides.append("actor.recompute_granularity=full")
                        overrides += [f"actor.{key}=null" for key in ("recompute_method", "recompute_num_layers",
                                                                       "recompute_modules")
                                      if getattr(cfg.actor.recompute, key) is not None]
                    # Every key this candidate sets differently from the run (a preset's offloads included).
                    overrides += [f"actor.{key}={str(value).lower()}" for key, value in keys.items()
                                  if key != "host_optimizer" and value != getattr(cfg.actor, key)]
                    if actor.optim.optimizer_cpu_offload != cfg.actor.optim.optimizer_cpu_offload:
                        overrides.append(f"actor.optim.optimizer_cpu_offload={str(actor.optim.optimizer_cpu_offload).lower()}")
                    if shrink > 1:
                        overrides += [f"{group}.{key}={value}" for group in ("actor", "ref")
                                      for key, value in batching[group].items()]
                    found.append(Suggestion(overrides, par.tensor_model_parallel_size
                                            * par.pipeline_model_parallel_size * par.expert_model_parallel_size,
                                            plan.peak.bytes, plan.total_seconds))
                    break  # the least offload that fits this layout and micro-batch
                else:
                    continue
                break  # the largest micro-batch that fits this layout
    found.sort(key=lambda s: (round(s.step_seconds, 2), s.model_parallel, s.peak_bytes))
    return found[:limit]


def _recompute_options(configured: Any) -> list[Any]:
    """The run's own recomputation, then full recomputation of every layer (when it is not that already): it costs
    one more forward pass in each update and saves almost every activation, often faster than more model
    parallelism or offload."""
    full = dataclasses.replace(configured, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1, recompute_modules=None)
    return [configured] if configured.megatron_kwargs() == full.megatron_kwargs() else [configured, full]
