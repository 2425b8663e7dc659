"""Checkpoint manager: atomic step dirs, latest file, retention, resume modes, crashes mid-write, 2 ranks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mcore_agentic.trainer.checkpoint import (
    COMPLETE_MARKER,
    LATEST_FILE,
    CheckpointError,
    CheckpointManager,
    find_latest,
)
from tests.helpers.distributed import run_distributed


def read_latest_file(root) -> int | None:
    """The step in verl's ``latest_checkpointed_iteration.txt`` (None when absent)."""
    path = root / LATEST_FILE
    return int(path.read_text().strip()) if path.is_file() else None

REPO = Path(__file__).resolve().parents[3]


def _write_model(value: float):
    def write(d: Path) -> None:
        torch.save({"w": torch.full((2,), value)}, d / "model.pt")

    return write


def test_save_load_roundtrip_restores_state_and_rng(tmp_path):
    mgr = CheckpointManager(tmp_path)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    path = mgr.save(3, {"sampler": {"epoch": 1, "position": 4}}, writers={"actor": _write_model(1.5)}, config={"a": 1})
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)  # move every stream on

    assert path == tmp_path / "global_step_3" and (path / COMPLETE_MARKER).is_file()
    assert read_latest_file(tmp_path) == 3 and find_latest(tmp_path) == path
    seen = {}
    loaded = mgr.load(path, readers={"actor": lambda d: seen.update(torch.load(d / "model.pt"))})
    assert loaded.global_step == 3 and loaded.trainer_state == {"sampler": {"epoch": 1, "position": 4}}
    assert torch.equal(seen["w"], torch.full((2,), 1.5))
    assert random.random() == expected[0] and float(np.random.rand()) == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_retention_keeps_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, {"step": step})
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3", "global_step_4"]
    assert read_latest_file(tmp_path) == 4


def test_resave_same_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(2, {"v": 1})
    mgr.save(2, {"v": 2})
    assert mgr.load(tmp_path / "global_step_2", restore_rng=False).trainer_state == {"v": 2}


def test_writer_raising_midway_leaves_previous_latest(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"v": 1}, writers={"actor": _write_model(1.0)})

    def crash(d: Path) -> None:
        (d / "shard_0.bin").write_bytes(b"x" * 100)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        mgr.save(2, {"v": 2}, writers={"actor": crash})
    assert read_latest_file(tmp_path) == 1
    assert find_latest(tmp_path) == tmp_path / "global_step_1"
    assert (tmp_path / ".tmp_global_step_2").exists() and not (tmp_path / "global_step_2").exists()
    # A partial dir that somehow got the final name but no marker is ignored too.
    (tmp_path / "global_step_9").mkdir()
    assert find_latest(tmp_path) == tmp_path / "global_step_1"
    assert mgr.resolve("auto") == tmp_path / "global_step_1"
    # The next good save succeeds and clears the debris of the crashed one.
    mgr.save(3, {"v": 3})
    assert not (tmp_path / ".tmp_global_step_2").exists() and read_latest_file(tmp_path) == 3


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mcore_agentic.trainer.checkpoint import CheckpointManager

    root = Path(sys.argv[1])
    mgr = CheckpointManager(root)
    mgr.save(1, {"v": 1}, writers={"actor": lambda d: (d / "w.bin").write_bytes(b"1")})

    def slow(d):
        (d / "half.bin").write_bytes(b"x" * 1000)
        (root / "started").write_text("1")
        time.sleep(60)

    mgr.save(2, {"v": 2}, writers={"actor": slow})
    """
)


def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], env=env, cwd=REPO)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "started").exists():
            assert proc.poll() is None, "writer process died before the second save started"
            assert time.time() < deadline, "writer never reached the second save"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    assert find_latest(tmp_path) == tmp_path / "global_step_1"
    assert (tmp_path / ".tmp_global_step_2" / "actor" / "half.bin").exists()
    assert CheckpointManager(tmp_path).load(find_latest(tmp_path), restore_rng=False).trainer_state == {"v": 1}


def test_resume_modes(tmp_path):
    mgr = CheckpointManager(tmp_path)
    assert mgr.resolve("auto") is None
    mgr.save(5, {})
    assert mgr.resolve("auto") == tmp_path / "global_step_5"
    assert mgr.resolve("disable") is None
    assert mgr.resolve(str(tmp_path / "global_step_5")) == tmp_path / "global_step_5"
    assert mgr.resolve("resume_path", str(tmp_path / "global_step_5")) == tmp_path / "global_step_5"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        mgr.resolve(str(tmp_path / "global_step_7"))


def _two_rank_save(rank: int, world_size: int, root: str) -> dict:
    torch.manual_seed(100 + rank)
    mgr = CheckpointManager(root)

    def write_shard(d: Path) -> None:
        (d / f"shard_{rank}.pt").write_bytes(str(rank).encode())

    path = mgr.save(7, {"from_rank": rank}, writers={"actor": write_shard})
    after_save = torch.rand(2)
    loaded = mgr.load(find_latest(root), readers={"actor": lambda d: None})
    return {
        "path": str(path),
        "shards": sorted(p.name for p in (path / "actor").iterdir()),
        "state": loaded.trainer_state,
        "rng_ok": torch.equal(torch.rand(2), after_save),
    }


def test_two_ranks_write_parts_and_rank0_finalises(tmp_path):
    results = run_distributed(_two_rank_save, world_size=2, args=(str(tmp_path),))
    for r in results:
        assert r["path"] == str(tmp_path / "global_step_7")
        assert r["shards"] == ["shard_0.pt", "shard_1.pt"]
        assert r["state"] == {"from_rank": 0}  # rank 0's trainer state is the one kept
        assert r["rng_ok"]  # each rank got its own RNG stream back
    assert read_latest_file(tmp_path) == 7
