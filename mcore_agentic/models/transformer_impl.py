"""``model.transformer_impl``: which megatron-core layer spec a model is built with, checked before it is,
and the GPU fusions that go with it."""

from __future__ import annotations

import importlib.util

import torch

from mcore_agentic.models.config import uses_transformer_engine
from mcore_agentic.utils.errors import ConfigError


def use_te_for(transformer_impl: str) -> bool | None:
    """``model.transformer_impl`` as :meth:`layer_spec`'s ``use_te``: local False, transformer_engine True, auto None.

    ``transformer_engine`` without TransformerEngine or without a GPU is a :class:`ConfigError`.
    """
    if transformer_impl == "local":
        return False
    if transformer_impl == "auto":
        return None
    if transformer_impl != "transformer_engine":
        raise ConfigError("model.transformer_impl", f"{transformer_impl!r} is not supported: use auto, local or transformer_engine")
    problem = transformer_engine_problem()
    if problem:
        raise ConfigError("model.transformer_impl", f"transformer_engine was asked for but {problem}; use local or auto")
    return True


def te_importable() -> bool:
    """TransformerEngine is installed (found without importing it: importing it initialises CUDA)."""
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_problem() -> str | None:
    """Why the TransformerEngine layer spec cannot be used here (None: it can)."""
    if not te_importable():
        return "TransformerEngine is not installed (pip install 'mcore-agentic[gpu]' on a GPU machine)"
    if not torch.cuda.is_available():
        return "torch sees no GPU, and TransformerEngine's layers run on CUDA only"
    return None


def te_spec_here(use_te: bool | None) -> bool:
    """A layer spec's ``use_te`` resolved on this machine (None: ``auto``)."""
    if use_te is not None:
        return use_te
    return uses_transformer_engine("auto", "cuda" if torch.cuda.is_available() else "cpu", te_importable())


def wgrad_fusion_kernel_available() -> bool:
    """apex's ``fused_weight_gradient_mlp_cuda``, which megatron's own linear layers (the output layer, even
    under the TE spec) require for ``gradient_accumulation_fusion``; TE's linears fuse without it."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def fusion_settings(use_te: bool, device: str) -> dict[str, bool]:
    """The ``TransformerConfig`` fusion flags for a model built with the TE spec (``use_te``) on ``device``.

    All on with the TE spec on CUDA, all off otherwise: the local spec must run on CPU, where these kernels do
    not exist (fused RoPE is TE's and ``TransformerConfig`` refuses it without TE). With them on:

    * ``bias_activation_fusion``: megatron's fused SwiGLU (``bias_swiglu_impl``); ``bias_dropout_fusion``:
      fused bias-dropout-add; ``masked_softmax_fusion``: megatron's fused softmax (Megatron-LM's default; TE's
      attention does its own);
    * ``apply_rope_fusion``: TE's fused RoPE. For packed rows it is TE's THD kernel, which reads ``cu_seqlens``
      on the GPU; megatron's unfused THD path calls ``.tolist()`` on them in every attention layer (a host
      sync per layer, twice: query and key);
    * ``gradient_accumulation_fusion``: every TE linear (``fuse_wgrad_accumulation``) accumulates its weight
      gradient straight into Megatron's fp32 ``main_grad``, with TE's own kernel: no bf16 ``weight.grad``, no
      extra add. It needs no apex. Megatron's own ``ColumnParallelLinear`` (the output layer, also under the TE
      spec) does need apex's kernel for it and refuses to be built without it; without apex the model is built
      so that the output layer alone takes the plain path (:func:`mcore_agentic.models.wgrad_fusion.
      split_wgrad_fusion`).

    ``persist_layer_norm`` stays off: it selects apex's persistent ``FusedLayerNorm`` kernel, which neither spec
    builds (TE's norms ignore it, torch's refuse it).
    """
    on = use_te and device == "cuda"
    return {
        "bias_activation_fusion": on,
        "bias_dropout_fusion": on,
        "masked_softmax_fusion": on,
        "apply_rope_fusion": on,
        "gradient_accumulation_fusion": on,
        "persist_layer_norm": False,
    }


def fusions_here(use_te: bool | None) -> dict[str, bool]:
    """:func:`fusion_settings` on this machine for a layer spec's ``use_te`` (None: ``auto``)."""
    return fusion_settings(te_spec_here(use_te), "cuda" if torch.cuda.is_available() else "cpu")


def thd_offsets_on_host(use_te: bool) -> bool:
    """Where a packed micro-batch's ``PackedSeqParams`` offsets (``cu_seqlens_*``) belong: the host for the local
    spec, the compute device for the TE spec.

    The local spec reads them as Python integers in every attention layer: megatron-core's unfused THD RoPE
    (``rope_utils._apply_rotary_pos_emb_thd``: ``.tolist()``, for the query and again for the key) and
    :class:`LocalDotProductAttention` (one segment at a time). On a GPU each read of a device tensor is a host
    sync, three per layer; host tensors cost none. TE's attention and its fused THD RoPE kernel
    (``apply_rope_fusion``, on with the TE spec on CUDA) read them on the device. Max sequence lengths stay Python
    integers either way (``PackedSeqParams.max_seqlen_*``: megatron sizes RoPE with them).
    """
    return not use_te
