"""Wall-clock timing of named phases: ``with timer("rollout", timings): ...``.

On GPU, kernels run asynchronously; pass ``sync=True`` (the default when CUDA is
available) so a phase's time includes the device work it queued, at the cost of
one synchronisation per phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

import torch


def _cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def timer(name: str, timings: MutableMapping[str, float], *, sync: bool | None = None) -> Iterator[None]:
    """Add the seconds spent in the block to ``timings[name]`` (accumulates over repeated phases)."""
    do_sync = torch.cuda.is_available() if sync is None else sync
    if do_sync:
        _cuda_sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        if do_sync:
            _cuda_sync()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


class PhaseTimer:
    """Timings of one training step: ``with t.phase("gen"): ...`` then ``t.pop()`` for the step's metrics."""

    def __init__(self, *, sync: bool | None = None):
        self.sync = sync
        self.timings: dict[str, float] = {}

    def phase(self, name: str):
        return timer(name, self.timings, sync=self.sync)

    def pop(self) -> dict[str, float]:
        """``{"timing_s/<phase>": seconds}`` of the phases since the last pop; resets."""
        out = {f"timing_s/{k}": v for k, v in self.timings.items()}
        self.timings = {}
        return out
