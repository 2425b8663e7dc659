"""``ParallelConfig``: how one model is split over ranks (TP, PP, virtual PP, CP, sequence parallel, EP).

Light imports only (dataclasses): the config tree composes this without pulling
in torch or megatron-core. ``__post_init__`` names fields relative to the group
(``tensor_model_parallel_size``); the config loader prefixes the group path
(``actor.tensor_model_parallel_size``). Cross-field rules that need the world size or the
model's shape live in :mod:`mcore_agentic.config.rules` (the one place for divisibility rules).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_agentic.utils.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes of one Megatron model (the actor, critic or reference).

    The data-parallel size is not set here: it is ``world_size // (TP * PP * CP)``.
    """

    tensor_model_parallel_size: int = 1
    """TP: ranks that split every weight matrix (attention heads, MLP columns). Must divide
    the number of attention heads and of query groups."""

    pipeline_model_parallel_size: int = 1
    """PP: ranks that each hold a consecutive slice of the layers. Must divide the number of layers."""

    virtual_pipeline_model_parallel_size: int | None = None
    """VPP: model chunks per pipeline rank (interleaved schedule); None disables interleaving.
    Needs PP > 1, and PP * VPP must divide the number of layers."""

    context_parallel_size: int = 1
    """CP: ranks that each hold 2 of the ``2 * CP`` load-balanced chunks of every sequence."""

    sequence_parallel: bool = False
    """Split LayerNorm/dropout activations along the sequence over the TP group. Needs TP > 1
    (and, in this project, TransformerEngine: refused on CPU)."""

    expert_model_parallel_size: int = 1
    """EP (mixture-of-experts models): ranks that each hold ``num_experts / EP`` of every MoE layer's experts;
    tokens reach their experts by all-to-all. Megatron carves the EP group out of the DP x CP ranks of one TP
    rank, so EP must divide ``TP * CP * DP / expert_tensor_parallel_size`` and the number of experts."""

    expert_tensor_parallel_size: int = 1
    """ETP: ranks that split each expert's weights (Megatron's default is TP; here 1, the only value gloo runs:
    its all-gather of unequal sizes is missing)."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "expert_tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1:
                raise ConfigError(
                    "virtual_pipeline_model_parallel_size", f"must be null or an integer >= 1, got {vpp!r}"
                )
            if self.pipeline_model_parallel_size == 1 and vpp > 1:
                raise ConfigError(
                    "virtual_pipeline_model_parallel_size",
                    f"={vpp} needs pipeline_model_parallel_size > 1: set it to null or raise "
                    "pipeline_model_parallel_size",
                )
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError("sequence_parallel", f"must be true or false, got {self.sequence_parallel!r}")
        if self.expert_tensor_parallel_size != 1:
            raise ConfigError(
                "expert_tensor_parallel_size",
                f"={self.expert_tensor_parallel_size} is not supported in this version: set 1 (experts whole on each "
                "expert-parallel rank; raise expert_model_parallel_size instead)",
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(
                "sequence_parallel",
                "needs tensor_model_parallel_size > 1 (it splits activations over the TP group): set it to false",
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica: TP * PP * CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
