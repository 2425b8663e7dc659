"""A tqdm progress bar over training steps with ETA, shown on rank 0 only."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm

from mcore_agentic.trainer.metrics import RESPONSE_LENGTH_KEY, REWARD_KEY, scalar


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


# The few numbers worth a glance in the bar; everything else goes to the tracker.
POSTFIX_KEYS = {REWARD_KEY: "reward", RESPONSE_LENGTH_KEY: "resp_len", "actor/pg_loss": "pg_loss"}


class StepProgress:
    """``update(metrics)`` once per step; ETA comes from tqdm's rate.

    ``enabled=None`` shows the bar on rank 0 only (torch.distributed rank, else ``$RANK``).
    """

    def __init__(self, total_steps: int, *, initial_step: int = 0, enabled: bool | None = None, file: Any = None):
        if enabled is None:
            enabled = _rank() == 0
        self.bar = (
            tqdm(total=total_steps, initial=initial_step, desc="training", unit="step", dynamic_ncols=True, file=file)
            if enabled
            else None
        )

    def update(self, metrics: Mapping[str, Any] | None = None) -> None:
        if self.bar is None:
            return
        if metrics:
            postfix = {short: f"{v:.4g}" for key, short in POSTFIX_KEYS.items() if (v := scalar(metrics.get(key))) is not None}
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
