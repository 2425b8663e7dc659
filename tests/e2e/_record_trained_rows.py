"""``launch/pretrain_rl.py`` with ``Actor.update_policy`` wrapped to save the rows each rank trains on.

Run under torchrun like the launcher; ``RECORD_ROWS_DIR`` names where each rank writes
``rank<k>-update<n>.pt``: the tensors of the batch its actor update received (token ids, masks,
trainer log-probs, advantages). The update itself runs unchanged.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_agentic.workers.actor import Actor  # noqa: E402

KEYS = ("prompts", "responses", "attention_mask", "response_mask", "old_log_probs", "advantages")
_update = Actor.update_policy
calls = [0]


def _recording_update(self, batch, *args, **kwargs):
    out = Path(os.environ["RECORD_ROWS_DIR"]) / f"rank{dist.get_rank()}-update{calls[0]}.pt"
    torch.save({k: batch[k].clone() for k in KEYS}, out)
    calls[0] += 1
    return _update(self, batch, *args, **kwargs)


Actor.update_policy = _recording_update

sys.argv[0] = str(ROOT / "launch" / "pretrain_rl.py")
import runpy  # noqa: E402

runpy.run_path(str(ROOT / "launch" / "pretrain_rl.py"), run_name="__main__")
