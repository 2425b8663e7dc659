"""Verified checkpoints: manifest at save, three kinds of damage, fallback, explicit refusal, pickles refused."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from mcore_agentic.trainer import manifest as mf
from mcore_agentic.trainer.checkpoint import (
    COMPLETE_MARKER,
    TRAINER_STATE_FILE,
    CheckpointError,
    CheckpointManager,
)
from tests.helpers.distributed import run_distributed

SHARD = "actor/shard.bin"


def _writer(seed: int):
    def write(d: Path) -> None:
        g = torch.Generator().manual_seed(seed)
        (d / "shard.bin").write_bytes(torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=g).numpy().tobytes())
        torch.save({"w": torch.full((4,), float(seed))}, d / "common.pt")

    return write


def _two_checkpoints(root: Path) -> CheckpointManager:
    mgr = CheckpointManager(root)
    for step in (1, 2):
        mgr.save(step, {"step": step}, writers={"actor": _writer(step)})
    return mgr


def test_manifest_lists_every_file_and_complete_records_its_digest(tmp_path):
    mgr = _two_checkpoints(tmp_path)
    step = tmp_path / "global_step_2"
    doc = json.loads((step / mf.MANIFEST_FILE).read_text())
    on_disk = mf.list_files(step, exclude=(COMPLETE_MARKER, mf.MANIFEST_FILE))
    assert sorted(doc["files"]) == sorted(on_disk) and SHARD in on_disk and TRAINER_STATE_FILE in on_disk
    assert all(doc["files"][n]["size"] == size for n, size in on_disk.items())
    assert doc["files"][SHARD][mf.HASH_NAME] == mf.file_digest(step / SHARD)
    marker = json.loads((step / COMPLETE_MARKER).read_text())
    assert marker["manifest"][mf.MANIFEST_FILE] == mf.bytes_digest((step / mf.MANIFEST_FILE).read_bytes())
    assert mgr.verify(step) == [] and mgr.verify(step, full=False) == []


def _zero_block(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 3)
        f.write(b"\0" * 100_000)
    assert path.stat().st_size == size


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


DAMAGE = {
    "zeroed": (SHARD, _zero_block, "checksum mismatch"),
    "truncated": (TRAINER_STATE_FILE, _truncate, "truncated"),
    "missing": ("actor/common.pt", os.remove, "missing"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_falls_back_on_auto_and_is_an_error_when_explicit(tmp_path, capsys, kind):
    mgr = _two_checkpoints(tmp_path)
    name, damage, words = DAMAGE[kind]
    newest = tmp_path / "global_step_2"
    damage(newest / name)

    assert mgr.resolve("auto") == tmp_path / "global_step_1"
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and name in warning[0] and words in warning[0] and "global_step_2" in warning[0]

    with pytest.raises(CheckpointError) as err:
        mgr.resolve("resume_path", str(newest))
    message = str(err.value)
    assert "\n" not in message and message.startswith("trainer.resume_from_path:") and name in message and words in message
    if kind == "zeroed":  # size unchanged: only the full check sees it
        assert mgr.verify(newest, full=False) == []


def test_no_checkpoint_verifies_is_an_error_not_a_fresh_start(tmp_path):
    mgr = _two_checkpoints(tmp_path)
    for step in (1, 2):
        _zero_block(tmp_path / f"global_step_{step}" / SHARD)
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies"):
        mgr.resolve("auto")


def test_altered_manifest_and_added_file_fail(tmp_path):
    mgr = _two_checkpoints(tmp_path)
    step = tmp_path / "global_step_2"
    (step / "actor" / "extra.bin").write_bytes(b"x")
    assert mgr.verify(step) == ["actor/extra.bin: not in the manifest (added after the save)"]
    os.remove(step / "actor" / "extra.bin")
    doc = json.loads((step / mf.MANIFEST_FILE).read_text())
    doc["files"][SHARD]["size"] += 1
    (step / mf.MANIFEST_FILE).write_text(json.dumps(doc))
    assert "altered since the save" in mgr.verify(step)[0]


class _Payload:
    """Unpickling it creates a file: stands for any code a planted pickle would run."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def _replant(step: Path, name: str, data: bytes) -> None:
    """What an attacker with write access does: replace a file and rewrite manifest + marker to match."""
    (step / name).write_bytes(data)
    doc = json.loads((step / mf.MANIFEST_FILE).read_text())
    doc["files"][name] = {"size": len(data), mf.HASH_NAME: mf.bytes_digest(data)}
    manifest = mf.manifest_bytes(doc["files"], doc["global_step"])
    (step / mf.MANIFEST_FILE).write_bytes(manifest)
    marker = json.loads((step / COMPLETE_MARKER).read_text())
    marker["manifest"][mf.MANIFEST_FILE] = mf.bytes_digest(manifest)
    (step / COMPLETE_MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("planted", [TRAINER_STATE_FILE, "rng_state_rank0.pt"])
def test_a_pickle_planted_as_trainer_state_is_refused_not_run(tmp_path, planted):
    mgr = _two_checkpoints(tmp_path)
    step = tmp_path / "global_step_2"
    ran = tmp_path / "code_ran"
    state = torch.load(step / TRAINER_STATE_FILE, weights_only=True)
    state["state"]["evil"] = _Payload(ran)
    import io

    buf = io.BytesIO()
    torch.save(state if planted == TRAINER_STATE_FILE else {"torch": _Payload(ran)}, buf)
    _replant(step, planted, buf.getvalue())
    assert mgr.resolve("auto") == step  # the bytes match the (rewritten) manifest ...
    with pytest.raises(CheckpointError, match="weights-only") as err:
        mgr.load(step)  # ... but the file cannot run code: it is loaded weights-only
    assert planted in str(err.value) and "\n" not in str(err.value)
    assert not ran.exists()


def test_a_pickle_planted_as_dcp_metadata_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)

    def write(d: Path) -> None:  # a real torch.distributed.checkpoint directory
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)

    step = mgr.save(1, {}, writers={"actor": write})
    assert mgr.verify(step) == []
    ran = tmp_path / "code_ran"
    _replant(step, "actor/.metadata", pickle.dumps(_Payload(ran)))
    problems = mgr.verify(step)
    assert len(problems) == 1 and "actor/.metadata" in problems[0] and "pathlib" in problems[0]
    assert not ran.exists()


def test_a_dotted_global_cannot_reach_other_modules(tmp_path):
    # Protocol 4 resolves "module" + "a.b.c" by attribute walk: planner.torch.ctypes.CDLL is ctypes.CDLL.
    module, name = b"torch.distributed.checkpoint.planner", b"torch.ctypes.CDLL"
    data = (b"\x80\x04" + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module + pickle.SHORT_BINUNICODE
            + bytes([len(name)]) + name + pickle.STACK_GLOBAL + pickle.SHORT_BINUNICODE + b"\x09libc.so.6"
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    (tmp_path / ".metadata").write_bytes(data)
    problem = mf.check_metadata_pickle(tmp_path / ".metadata")
    assert problem is not None and "torch.ctypes.CDLL" in problem


def test_retention_never_deletes_the_last_good_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    mgr.save(1, {}, writers={"actor": _writer(1)})
    mgr.save(2, {}, writers={"actor": _writer(2)})
    _truncate(tmp_path / "global_step_2" / SHARD)  # damaged after its save
    mgr.save(3, {}, writers={"actor": _writer(3)})
    # Good ones are 1 and 3: keeping two of them keeps step 1; the damaged step 2 does not count.
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_1", "global_step_2", "global_step_3"]
    mgr.save(4, {}, writers={"actor": _writer(4)})
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3", "global_step_4"]


def _two_rank_verify(rank: int, world_size: int, root: str) -> dict:
    mgr = CheckpointManager(root)

    def write(d: Path) -> None:
        (d / f"shard_{rank}.bin").write_bytes(bytes([rank]) * (100_000 * (rank + 1)))

    path = mgr.save(3, {}, writers={"actor": write})
    clean = mgr.verify(path)
    if rank == 1:
        _zero_block(path / "actor" / "shard_1.bin")
    torch.distributed.barrier()
    damaged = mgr.verify(path)
    return {"clean": clean, "damaged": damaged, "files": sorted(json.loads((path / mf.MANIFEST_FILE).read_text())["files"])}


def test_two_ranks_hash_their_shares_and_agree_on_damage(tmp_path):
    results = run_distributed(_two_rank_verify, world_size=2, args=(str(tmp_path),))
    for r in results:
        assert r["clean"] == []
        assert r["files"] == ["actor/shard_0.bin", "actor/shard_1.bin", "rng_state_rank0.pt", "rng_state_rank1.pt",
                              TRAINER_STATE_FILE]
        assert r["damaged"] == ["actor/shard_1.bin: content differs from the save (checksum mismatch, size unchanged)"]
    assert mf.shares({"a": 10, "b": 5, "c": 5}, 2) == [["a"], ["b", "c"]]
