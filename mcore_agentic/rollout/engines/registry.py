"""The rollout engines in one table: every place that needs to know an engine reads its :class:`EngineKind` here.

The config's allowed ``rollout.name`` values and its TP limit (``rollout/config.py``), the cross-group rules
(``config/rules.py``: the devices it runs on), the pre-flight (``trainer/preflight.py``: its package and extra),
the planner (``plan/plan.py``: whether ``gpu_memory_utilization`` sizes it), ``rollout.engines.build_engine``
(its builder) and the standalone server's ``--engine`` choices (``endpoint/serve.py``). Adding an
engine is one entry here plus its adapter (a :class:`~mcore_agentic.rollout.engines.base.RolloutEngine`) and its
builder (``rollout/engines/builders.py``).

Light: standard library only (the config tree imports it through ``rollout/config.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKind:
    """One rollout engine: what the config, the rules, the pre-flight and the planner need to know of it."""

    name: str
    """``rollout.name``."""
    description: str
    """What it is, in a message (``the transformers engine``)."""
    builder: str
    """``module:function`` that builds it: ``(cfg: RolloutConfig, model: EngineModel, *, device, seed) -> engine``."""
    package: str | None
    """The module it needs beyond the base install (the pre-flight looks for it); None: none."""
    extras: Mapping[str, str]
    """The ``setup.py`` extra that installs ``package``, by device (``cuda``, ``cpu``)."""
    devices: tuple[str, ...]
    """The device types it runs on (``trainer.device``)."""
    max_tensor_parallel_size: int | None
    """The largest ``rollout.tensor_model_parallel_size`` it takes; None: any."""
    shards_model: bool
    """Whether rollout TP shards the model over the group's GPUs (else it only sets how many ranks share it)."""
    sized_by_gpu_memory_utilization: bool
    """Whether ``rollout.gpu_memory_utilization`` sizes its share of the GPU (the planner counts that fraction)."""

    def install_hint(self) -> str:
        """``pip install -e '.[vllm]' (cuda) or '.[cpu]' (cpu)``: how to get ``package``."""
        if len(set(self.extras.values())) == 1:
            return f"pip install -e '.[{next(iter(self.extras.values()))}]'"
        return "pip install -e " + " or ".join(f"'.[{extra}]' ({device})" for device, extra in self.extras.items())


ENGINE_KINDS: tuple[EngineKind, ...] = (
    EngineKind(
        name="hf", description="transformers", builder="mcore_agentic.rollout.engines.builders:build_hf",
        package=None, extras={}, devices=("cpu", "cuda"), max_tensor_parallel_size=None, shards_model=False,
        sized_by_gpu_memory_utilization=False,
    ),
    EngineKind(
        name="vllm", description="vLLM in-process", builder="mcore_agentic.rollout.engines.builders:build_vllm",
        package="vllm", extras={"cuda": "vllm", "cpu": "cpu"}, devices=("cpu", "cuda"), max_tensor_parallel_size=1,
        shards_model=False, sized_by_gpu_memory_utilization=True,
    ),
    EngineKind(
        name="sglang", description="SGLang in-process", builder="mcore_agentic.rollout.engines.builders:build_sglang",
        package="sglang", extras={"cuda": "sglang"}, devices=("cuda",), max_tensor_parallel_size=None,
        shards_model=True, sized_by_gpu_memory_utilization=True,
    ),
)
"""Every engine, the reference (``hf``) first."""

ENGINE_NAMES: tuple[str, ...] = tuple(kind.name for kind in ENGINE_KINDS)


def engine_kind(name: str) -> EngineKind:
    """The table's entry for ``rollout.name=name`` (KeyError naming the engines if there is none)."""
    for kind in ENGINE_KINDS:
        if kind.name == name:
            return kind
    raise KeyError(f"unknown engine {name!r}; use one of {list(ENGINE_NAMES)}")


def engines_on(device: str) -> tuple[str, ...]:
    """The names of the engines that run on ``device`` (a device type: ``cpu``, ``cuda``), in table order."""
    return tuple(kind.name for kind in ENGINE_KINDS if device in kind.devices)
