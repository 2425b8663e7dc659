"""``model.transformer_impl``: which megatron-core layer spec a model is built with, checked before it is."""

from __future__ import annotations

import torch

from mcore_agentic.config.errors import ConfigError


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


def transformer_engine_problem() -> str | None:
    """Why the TransformerEngine layer spec cannot be used here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return "TransformerEngine is not installed (pip install 'mcore-agentic[gpu]' on a GPU machine)"
    if not torch.cuda.is_available():
        return "torch sees no GPU, and TransformerEngine's layers run on CUDA only"
    return None
