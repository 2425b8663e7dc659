"""Seed every random number generator a run uses from one number; capture and restore their global states."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class RngState:
    """The global torch / CUDA / Python / NumPy RNG states: what a rollout and the training loop must not
    share, and what vLLM's start-up reseeds in the trainer's process."""

    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None
    python: Any
    numpy: Any

    @classmethod
    def capture(cls) -> RngState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state())

    @classmethod
    def seeded(cls, seed: int) -> RngState:
        """The states each generator has right after being seeded with ``seed``; the global ones are untouched."""
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            saved = torch.cuda.get_rng_state_all()
            torch.cuda.manual_seed_all(seed)
            cuda = torch.cuda.get_rng_state_all()
            torch.cuda.set_rng_state_all(saved)
        numpy_state = np.random.RandomState(seed % 2**32).get_state()
        return cls(torch.Generator().manual_seed(seed).get_state(), cuda, random.Random(seed).getstate(), numpy_state)

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
