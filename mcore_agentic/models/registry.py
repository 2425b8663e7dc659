"""Exact-match registry: HF ``config.architectures[0]`` -> the bridge class that serves it."""

from __future__ import annotations

from typing import Any

from mcore_agentic.models.bridge import Bridge, config_error
from mcore_agentic.models.bridges.llama import LlamaBridge
from mcore_agentic.models.bridges.qwen2 import Qwen2Bridge
from mcore_agentic.models.bridges.qwen3 import Qwen3Bridge
from mcore_agentic.models.bridges.qwen3_moe import Qwen3MoeBridge

BRIDGES: dict[str, type[Bridge]] = {
    cls.architecture: cls for cls in (Qwen2Bridge, Qwen3Bridge, Qwen3MoeBridge, LlamaBridge)
}


def get_bridge(hf_config: Any, *, make_vocab_size_divisible_by: int = 128, lm_head: bool = True) -> Bridge:
    """The bridge bound to ``hf_config``, chosen by the exact string ``hf_config.architectures[0]``
    (``lm_head=False``: the output layer is not exported, see :class:`~mcore_agentic.models.bridge.Bridge`)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if len(archs) != 1:
        raise config_error("architectures", f"{archs} must name exactly one architecture, one of {sorted(BRIDGES)}")
    if archs[0] not in BRIDGES:
        raise config_error("architectures", f"{archs[0]!r} has no bridge: supported are {sorted(BRIDGES)}")
    return BRIDGES[archs[0]](hf_config, make_vocab_size_divisible_by=make_vocab_size_divisible_by, lm_head=lm_head)
