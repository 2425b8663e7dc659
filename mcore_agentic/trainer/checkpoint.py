"""Checkpoint directories that are either complete or ignored.

Layout under the checkpoint root (``trainer.default_local_dir``)::

    global_step_<k>/
        COMPLETE                  marker written last, before the directory gets its final name
        trainer_state.pt          step, dataloader/sampler state, trainer metric state (rank 0)
        rng_state_rank<r>.pt      python/numpy/torch(/cuda) RNG states of rank r
        <name>/                   one empty subdir per writer callback (e.g. "actor" for a Megatron
                                  dist checkpoint written by the worker code on every rank)
    latest_checkpointed_iteration.txt     "<k>", replaced atomically after global_step_<k> is complete

A save goes to ``.tmp_global_step_<k>/``; after every rank has written its
part (barrier), rank 0 writes ``COMPLETE`` and renames the directory with one
``os.replace``, then rewrites the ``latest`` file through a temp file and
``os.replace``. A crash at any point leaves the previous checkpoint as the
latest one: :func:`find_latest` only considers ``global_step_<k>`` directories
holding the marker. Model and optimizer state are not this module's business:
the trainer passes writer/reader callbacks that get a directory.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STEP_PREFIX = "global_step_"
STAGING_PREFIX = ".tmp_" + STEP_PREFIX
LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.pt"
FORMAT_VERSION = 1
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")

Writer = Callable[[Path], None]
"""Writes one part of a checkpoint into the (already created, empty) directory it is given."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint directory counts only when its marker exists."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def list_complete(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete ``global_step_<k>`` under ``root``; partial or staging directories are ignored.

    The scan, not the ``latest`` file, decides: a crash between the rename and the
    ``latest`` update still finds the renamed (complete) directory.
    """
    complete = list_complete(root)
    return complete[-1][1] if complete else None


def read_latest_file(root: str | os.PathLike) -> int | None:
    """The step recorded in ``latest_checkpointed_iteration.txt`` (None when absent)."""
    path = Path(root) / LATEST_FILE
    if not path.is_file():
        return None
    return int(path.read_text().strip())


def step_of(path: str | os.PathLike) -> int:
    m = _STEP_RE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a {STEP_PREFIX}<k> checkpoint directory")
    return int(m.group(1))


def resolve_resume_path(root: str | os.PathLike, resume_mode: str, resume_from_path: str | None = None) -> Path | None:
    """Which checkpoint to resume from, per ``trainer.resume_mode``.

    ``auto``: the latest complete checkpoint under ``root`` or None; ``disable``: None;
    ``resume_path``: ``resume_from_path``; anything else is itself a checkpoint path.
    An explicit path must be a complete checkpoint, else ``FileNotFoundError`` says why.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return find_latest(root)
    explicit = resume_from_path if resume_mode == "resume_path" else resume_mode
    if not explicit:
        raise FileNotFoundError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    path = Path(explicit)
    if not is_complete(path):
        raise FileNotFoundError(
            f"trainer.resume_from_path: {path} is not a complete checkpoint (no {COMPLETE_MARKER} marker); "
            f"complete ones under its parent: {[str(p) for _, p in list_complete(path.parent)]}"
        )
    return path


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) CUDA generator states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load` hands back to the trainer."""

    path: Path
    global_step: int
    trainer_state: dict[str, Any]
    """The mapping the trainer passed to ``save`` (dataloader/sampler state, metric state, ...)."""


class CheckpointManager:
    """Saves and loads ``global_step_<k>`` directories under ``root`` atomically, on one or many ranks.

    Every rank calls :meth:`save` with the same step; each rank runs the writer
    callbacks (SPMD code such as Megatron's dist checkpointing writes its shard
    from every rank) and its RNG state, rank 0 writes the trainer state and
    finalises after a barrier. ``barrier`` defaults to ``torch.distributed.barrier``
    on ``process_group`` when torch.distributed is initialised, else a no-op.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        rank: int | None = None,
        process_group: Any = None,
        barrier: Callable[[], None] | None = None,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be positive or null, got {max_to_keep}")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank(process_group) if distributed else 0)
        if barrier is not None:
            self._barrier = barrier
        elif distributed:
            self._barrier = lambda: dist.barrier(group=process_group)
        else:
            self._barrier = lambda: None

    # ----------------------------------------------------------------- save
    def save(
        self,
        step: int,
        trainer_state: Mapping[str, Any],
        writers: Mapping[str, Writer] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` and make it the latest; returns its final directory.

        ``trainer_state`` (rank 0's is kept) must be picklable; ``writers`` maps a
        subdirectory name to a callback run on every rank with that directory;
        ``config`` (optional) is stored as ``config.json`` for reference.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        writers = dict(writers or {})
        for name in writers:
            if not name or "/" in name or name in (COMPLETE_MARKER, TRAINER_STATE_FILE) or name.startswith("."):
                raise ValueError(f"checkpoint writer name {name!r} must be a plain directory name")
        staging = self.root / f"{STAGING_PREFIX}{step}"
        final = self.root / step_dir_name(step)

        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if staging.exists():  # left by a crashed save of the same step
                shutil.rmtree(staging)
            staging.mkdir()
            for name in writers:
                (staging / name).mkdir()
        self._barrier()

        for name, write in writers.items():
            write(staging / name)
        torch.save(capture_rng_state(), staging / f"rng_state_rank{self.rank}.pt")
        if self.rank == 0:
            torch.save(
                {"format_version": FORMAT_VERSION, "global_step": step, "state": dict(trainer_state)},
                staging / TRAINER_STATE_FILE,
            )
            if config is not None:
                (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self._barrier()  # every rank's part is on disk

        if self.rank == 0:
            _atomic_write_text(
                staging / COMPLETE_MARKER, json.dumps({"global_step": step, "time": time.time()}) + "\n"
            )
            _fsync_dir(staging)
            if final.exists():  # re-saving a step (e.g. after resuming from it): retire the old copy first
                retired = self.root / f".old_{final.name}_{os.getpid()}"
                os.replace(final, retired)
                shutil.rmtree(retired)
            os.replace(staging, final)
            _fsync_dir(self.root)
            _atomic_write_text(self.root / LATEST_FILE, f"{step}\n")
            self._apply_retention()
        self._barrier()  # nobody reads or moves on before the rename is done
        return final

    def _apply_retention(self) -> None:
        complete = list_complete(self.root)
        newest = complete[-1][0] if complete else -1
        # Staging dirs of older steps are debris of crashed saves.
        for child in self.root.iterdir():
            if child.name.startswith(STAGING_PREFIX) and child.name[len(STAGING_PREFIX) :].isdigit():
                if int(child.name[len(STAGING_PREFIX) :]) < newest:
                    shutil.rmtree(child, ignore_errors=True)
        if self.max_to_keep is None:
            return
        for _, path in complete[: -self.max_to_keep]:
            # Un-mark first so a crash mid-delete leaves an ignored directory, never a half one that counts.
            (path / COMPLETE_MARKER).unlink()
            shutil.rmtree(path, ignore_errors=True)

    # ----------------------------------------------------------------- load
    def latest(self) -> Path | None:
        return find_latest(self.root)

    def load(
        self,
        path: str | os.PathLike,
        readers: Mapping[str, Writer] | None = None,
        restore_rng: bool = True,
    ) -> LoadedCheckpoint:
        """Read a complete checkpoint: trainer state, this rank's RNG state, then each reader on its subdir."""
        path = Path(path)
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
        # Our own file (numpy RNG state is not a tensor): full unpickling is intended.
        blob = torch.load(path / TRAINER_STATE_FILE, weights_only=False)
        if blob.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: checkpoint format {blob.get('format_version')} != {FORMAT_VERSION}")
        if restore_rng:
            rng_file = path / f"rng_state_rank{self.rank}.pt"
            if not rng_file.is_file():
                raise FileNotFoundError(
                    f"{rng_file} missing: the checkpoint was written by fewer ranks; pass restore_rng=False "
                    "to resume with fresh RNG streams"
                )
            restore_rng_state(torch.load(rng_file, weights_only=False))
        for name, read in (readers or {}).items():
            sub = path / name
            if not sub.is_dir():
                raise FileNotFoundError(f"{path} has no '{name}' part; it holds {sorted(p.name for p in path.iterdir())}")
            read(sub)
        return LoadedCheckpoint(path=path, global_step=int(blob["global_step"]), trainer_state=blob["state"])
