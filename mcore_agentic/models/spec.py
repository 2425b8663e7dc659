"""``ModelSpec``: the run's model as every worker and rollout engine builds it, in one frozen object.

The trainer builds it once from the config (``trainer.build.model_spec``: the ``model`` group, the
actor's parallel sizes, the tokenizer's vocabulary, the rollout's temperature, the routing-replay shape)
and hands the same object to the actor, reference, critic (each through its
:class:`~mcore_agentic.workers.megatron_model.MegatronModel`) and to the rollout engine builder
(:func:`mcore_agentic.rollout.engines.build_engine`). A new model option is a field of the ``model``
config group, a field here, and the one place that reads it. Per-role settings (batching, optimizer,
offload, losses) stay in each role's own config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.utils.errors import ConfigError

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""``model.dtype``'s names."""


@dataclass(frozen=True)
class ModelSpec:
    """What building the run's model needs: the checkpoint, its Megatron layout, and how log-probs read it."""

    model_path: str
    """Directory of the Hugging Face checkpoint (``model.model_path``; a ``Path`` is kept as its string)."""
    dtype: str = "float32"
    """Parameter dtype, one of :data:`DTYPES` (``model.dtype``)."""
    transformer_impl: str = "auto"
    """Layer spec: ``local``, ``transformer_engine`` or ``auto`` (``model.transformer_impl``)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron's vocabulary padding multiple (times TP) (``model.make_vocab_size_divisible_by``)."""
    use_remove_padding: bool = True
    """Packed (THD) micro-batches; false: padded ``[rows, longest]`` ones (``model.use_remove_padding``)."""
    logits_chunk_mb: int = 256
    """MiB of fp32 logits made at a time on each rank (``model.logits_chunk_mb``; 0: the whole logits at once)."""
    vocab_size: int | None = None
    """The ids log-probs normalise over: the tokenizer's, which the rollout engine samples from (a checkpoint's
    embedding table may be padded past it); None: the checkpoint's."""
    temperature: float = 1.0
    """The temperature log-probs divide the logits by: the rollout's sampling temperature (1 for greedy rollouts)."""
    routing_shape: tuple[int, int] | None = None
    """``(moe_layers, top_k)`` of the routed experts the rollout engine records (``actor.moe.routing_replay`` on a
    mixture-of-experts model); None: it records none."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the model splits over ranks (``actor.*_parallel_size``, ``actor.sequence_parallel``): Megatron keeps one
    layout per process, so the actor, reference and critic share it."""

    def __post_init__(self) -> None:
        if isinstance(self.model_path, Path):
            object.__setattr__(self, "model_path", str(self.model_path))
        if self.dtype not in DTYPES:
            raise ConfigError("model.dtype", f"{self.dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        if not self.temperature > 0:
            raise ConfigError("rollout.temperature", f"{self.temperature} must be > 0 (greedy rollouts: 1)")
        if self.routing_shape is not None:
            object.__setattr__(self, "routing_shape", tuple(int(n) for n in self.routing_shape))

    @property
    def torch_dtype(self) -> Any:
        """:attr:`dtype` as a ``torch.dtype``."""
        import torch

        return getattr(torch, self.dtype)


def logits_chunk_tokens(chunk_mb: int, vocab_local: int) -> int:
    """Tokens whose fp32 logits over ``vocab_local`` ids fit ``chunk_mb`` MiB (``model.logits_chunk_mb``), at least
    one; 0 when ``chunk_mb`` is 0 (the whole logits at once)."""
    if chunk_mb <= 0:
        return 0
    return max(chunk_mb * 2**20 // 4 // max(vocab_local, 1), 1)


__all__ = ["DTYPES", "ModelSpec", "logits_chunk_tokens"]
