"""Generation engines behind one async interface: transformers (the reference), vLLM (CPU and GPU) and SGLang (GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines.base import RolloutEngine

SGLANG_BASE_PORT = 30000
"""Engine ``i`` of a node: ``port=SGLANG_BASE_PORT + 100 * i`` (unbound on one node: IPC + a free NCCL port)."""


class EngineModel(Protocol):
    """What an engine reads of the run's model spec (``mcore_agentic.models.spec.ModelSpec``, which the trainer
    builds once; rollout does not import ``models``, so the spec arrives typed by this protocol)."""

    @property
    def model_path(self) -> str:
        """The local HF checkpoint directory."""

    @property
    def dtype(self) -> str:
        """``model.dtype``'s names: ``float32``, ``bfloat16``, ``float16``."""

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """``(moe_layers, top_k)`` of a mixture-of-experts model whose routers' choices each request returns
        (``actor.moe.routing_replay``; hf and sglang); None: none."""


def build_engine(cfg: RolloutConfig, model: EngineModel, *, device: str, seed: int | None) -> RolloutEngine:
    """The engine ``rollout.name`` names, built by its entry's builder in the engine table
    (:mod:`~mcore_agentic.rollout.engines.registry`; the builders are :mod:`~mcore_agentic.rollout.engines.builders`,
    the one place engines are built and read the model spec), from the model spec's local HF checkpoint.

    ``device``: this rank's device (``"cpu"``, ``"cuda:3"``); ``seed``: the engine's sampling seed (the trainer
    passes the run's ``seed``). From ``model``: the checkpoint, the dtype, and the routing shape of a
    mixture-of-experts model whose routed experts each request returns.
    """
    import importlib

    module, _, function = cfg.engine.builder.partition(":")
    builder = getattr(importlib.import_module(module), function)
    return builder(cfg, model, device=device, seed=seed)
