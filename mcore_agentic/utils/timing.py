"""Wall-clock timing of named phases: ``with timer("rollout", timings): ...``.

On GPU, kernels run asynchronously; pass ``sync=True`` (the default when CUDA is
available) so a phase's time includes the device work it queued, at the cost of
one synchronisation per phase.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, MutableMapping
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
    """Timings of one training step: ``with t.phase("gen"): ...`` then ``t.pop()`` for the step's metrics.

    ``on_end(name)`` is called when a phase ends (the GPU metrics read the device there); ``readings()`` gives what
    it read, popped with the timings (``gpu/*`` on GPUs).
    """

    def __init__(self, *, sync: bool | None = None, on_end: Callable[[str], None] | None = None,
                 readings: Callable[[], dict[str, float]] | None = None):
        self.sync = sync
        self.on_end = on_end
        self.readings = readings
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with timer(name, self.timings, sync=self.sync):
            yield
        if self.on_end is not None:
            self.on_end(name)

    def pop(self) -> dict[str, float]:
        """``{"timing_s/<phase>": seconds}`` of the phases since the last pop, and the readings; resets."""
        out = {f"timing_s/{k}": v for k, v in self.timings.items()}
        self.timings = {}
        if self.readings is not None:
            out.update(self.readings())
        return out
