"""Stand-ins for TransformerEngine's layers, so megatron-core's own TE layer spec builds a model on CPU.

TransformerEngine does not install without CUDA. Each stand-in takes the arguments megatron-core builds the TE
layer with and makes the parameters TE makes, under TE's names and per-rank shapes (``weight``,
``layer_norm_weight``; a ``GroupedLinear``'s ``weight<i>`` per GEMM); none has a forward. Each linear keeps what TE
would get as ``fuse_wgrad_accumulation`` (the config's ``gradient_accumulation_fusion``).

:func:`te_stand_ins` puts them where megatron-core's ``TESpecProvider`` reads its TE classes, and that provider
where ``get_gpt_layer_with_transformer_engine_spec`` reads it (without TE it is never imported there), so the spec
is megatron-core's own: ``TEGroupedMLP`` or ``SequentialMLP`` experts, as its provider chooses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch


def _size(group: Any) -> int:
    return 1 if group is None else group.size()


def _param(*shape: int, config: Any) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))


class _Linear(torch.nn.Module):
    """TE's ``Linear`` (column- or row-parallel): ``weight`` ``[out, in]`` split over the TP group."""

    split_out = True

    def __init__(self, input_size: int, output_size: int, *, config: Any, bias: bool = False, tp_group: Any = None,
                 **_: Any) -> None:
        super().__init__()
        tp = _size(tp_group)
        out, inp = (output_size // tp, input_size) if self.split_out else (output_size, input_size // tp)
        self.weight = _param(out, inp, config=config)
        if bias:
            self.bias = _param(out if self.split_out else output_size, config=config)
        self.fuse_wgrad_accumulation = bool(config.gradient_accumulation_fusion)


class TEColumnParallelLinear(_Linear):
    pass


class TERowParallelLinear(_Linear):
    split_out = False


class TELayerNormColumnParallelLinear(_Linear):
    """TE's ``LayerNormLinear``: the norm before the linear, ``layer_norm_weight``."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = _param(input_size, config=config)


class TENorm(torch.nn.Module):
    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = _param(hidden_size, config=config)


class TEDotProductAttention(torch.nn.Module):
    def __init__(self, **_: Any) -> None:
        super().__init__()


class _GroupedLinear(torch.nn.Module):
    """TE's ``GroupedLinear``: one ``weight<i>`` ``[out, in]`` per GEMM (per local expert), split over expert TP."""

    split_out = True

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, bias: bool = False,
                 pg_collection: Any = None, **_: Any) -> None:
        super().__init__()
        tp = _size(getattr(pg_collection, "expt_tp", None))
        out, inp = (output_size // tp, input_size) if self.split_out else (output_size, input_size // tp)
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", _param(out, inp, config=config))
            if bias:
                self.register_parameter(f"bias{i}", _param(out, config=config))
        self.fuse_wgrad_accumulation = bool(config.gradient_accumulation_fusion)


class TEColumnParallelGroupedLinear(_GroupedLinear):
    pass


class TERowParallelGroupedLinear(_GroupedLinear):
    split_out = False


STAND_INS: dict[str, type] = {
    "TEColumnParallelLinear": TEColumnParallelLinear,
    "TERowParallelLinear": TERowParallelLinear,
    "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinear,
    "TENorm": TENorm,
    "TEDotProductAttention": TEDotProductAttention,
    "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinear,
    "TERowParallelGroupedLinear": TERowParallelGroupedLinear,
}
LINEARS = (_Linear, _GroupedLinear)


@contextmanager
def te_stand_ins() -> Iterator[None]:
    """megatron-core's TE layer spec built from the stand-ins, inside the block."""
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as specs

    with ExitStack() as stack:
        for name, cls in STAND_INS.items():
            stack.enter_context(mock.patch.object(provider, name, cls))
        stack.enter_context(mock.patch.object(provider, "is_te_min_version", lambda *_a, **_k: True))
        stack.enter_context(mock.patch.object(specs, "TESpecProvider", provider.TESpecProvider, create=True))
        yield
