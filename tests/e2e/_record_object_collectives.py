"""``launch/pretrain_rl.py`` with torch.distributed's object collectives wrapped to record their payloads.

Run under torchrun like the launcher; ``RECORD_OBJECTS_DIR`` names where each rank writes
``rank<k>.json``: every object collective called inside ``RLTrainer.train_step`` with the
pickled size of what this rank passed in. The collectives still run unchanged.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

WRAPPED = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
records: list[dict] = []
in_step = [False]


def _size(obj) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - unpicklable: the collective itself will say so
        return -1


def _wrap(name: str):
    original = getattr(dist, name)

    @functools.wraps(original)
    def recorder(*args, **kwargs):
        if in_step[0]:
            payload = {"all_gather_object": lambda: args[1], "broadcast_object_list": lambda: args[0],
                       "gather_object": lambda: args[0], "scatter_object_list": lambda: args[1]}[name]()
            where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack(limit=6)[:-1]]
            records.append({"fn": name, "bytes": _size(payload), "where": where})
        return original(*args, **kwargs)

    setattr(dist, name, recorder)


for fn in WRAPPED:
    _wrap(fn)

from mcore_agentic.trainer.loop import RLTrainer  # noqa: E402

_step = RLTrainer.train_step


def _recording_step(self, *args, **kwargs):
    in_step[0] = True
    try:
        return _step(self, *args, **kwargs)
    finally:
        in_step[0] = False
        out = Path(os.environ["RECORD_OBJECTS_DIR"]) / f"rank{dist.get_rank()}.json"
        out.write_text(json.dumps(records))


RLTrainer.train_step = _recording_step

sys.argv[0] = str(ROOT / "launch" / "pretrain_rl.py")
import runpy  # noqa: E402

runpy.run_path(str(ROOT / "launch" / "pretrain_rl.py"), run_name="__main__")
