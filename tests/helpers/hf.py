"""Test helpers over Hugging Face checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from mcore_agentic.models.hf_io import SafetensorsState


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the (small) checkpoint at ``path``, eagerly."""
    state = SafetensorsState(path)
    return {name: state[name] for name in state}
