"""Checkpoint directories that are complete and verified, or ignored.

Layout under the checkpoint root (``trainer.default_local_dir``)::

    global_step_<k>/
        COMPLETE                  marker written last: step, time, the manifest's BLAKE3 digest
        MANIFEST.json             every other file's size and BLAKE3 digest (see :mod:`.manifest`)
        trainer_state.pt          step, dataloader/sampler state, trainer metric state (rank 0; weights-only)
        rng_state_rank<r>.pt      python/numpy/torch(/cuda) RNG states of rank r (weights-only)
        <name>/                   one subdir per writer callback (e.g. "actor" for a Megatron
                                  dist checkpoint written by the worker code on every rank)
    latest_checkpointed_iteration.txt     "<k>", replaced atomically after global_step_<k> is complete

A save goes to ``.tmp_global_step_<k>/``; after every rank has written its
part (barrier), the ranks hash the files between them, rank 0 writes the
manifest and ``COMPLETE`` and renames the directory with one ``os.replace``,
then rewrites the ``latest`` file through a temp file and ``os.replace``. A
crash at any point leaves the previous checkpoint as the latest one: only
``global_step_<k>`` directories holding the marker count.

Before a resume, :meth:`CheckpointManager.resolve` verifies the candidate
against its manifest (``trainer.checkpoint_verify``: every byte, or sizes
only). With ``resume_mode=auto`` a checkpoint that fails is skipped with one
warning naming the bad file and the newest one that passes is used; an
explicit path that fails is a one-line :class:`CheckpointError`. Trainer state
and RNG files hold tensors and plain containers only and load with
``torch.load(weights_only=True)``: a pickle placed there is refused, never run.
Model and optimizer state are not this module's business: the trainer passes
writer/reader callbacks that get a directory.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm
from mcore_agentic.trainer import manifest as mf
from mcore_agentic.utils.errors import ConfigError, first_line

STEP_PREFIX = "global_step_"
STAGING_PREFIX = ".tmp_" + STEP_PREFIX
LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.pt"
FORMAT_VERSION = 2
"""2: weights-only trainer state and RNG files, manifest + digest in COMPLETE (1 pickled numpy state)."""
VERIFY_LEVELS = ("full", "size")
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


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from: one line naming the file and the fix."""


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) CUDA generator states, as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
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


def _load_weights_only(path: Path) -> Any:
    """``torch.load(weights_only=True)``; a file that needs more (a pickle with code) is a CheckpointError."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError of a torn zip, ...
        raise CheckpointError(
            "trainer.resume_from_path",
            f"{path} does not load as a weights-only torch file ({first_line(exc)}); it was not written by "
            "this trainer or is damaged: resume from another checkpoint",
        ) from None


def read_marker(path: Path) -> dict[str, Any]:
    """The ``COMPLETE`` marker's record ({} when unreadable)."""
    try:
        record = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load` hands back to the trainer."""

    path: Path
    global_step: int
    trainer_state: dict[str, Any]
    """The mapping the trainer passed to ``save`` (dataloader/sampler state, metric state, ...)."""


def summarize(problems: list[str]) -> str:
    """The first problem of a verification, and how many more there are (for one-line messages)."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{problems[0]}{more}"


def _entry_size(entry: Any) -> int:
    try:
        return int(entry.get("size", 0))
    except (AttributeError, TypeError, ValueError):
        return 0


class _Group:
    """The few collectives the manager needs, on ``process_group`` or trivial in one process."""

    def __init__(self, rank: int | None, process_group: Any, barrier: Callable[[], None] | None):
        distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        self.rank = rank if rank is not None else (dist.get_rank(process_group) if distributed else 0)
        # An injected rank or barrier (tests, or a caller with its own sync) means: no collectives of ours.
        self.distributed = distributed and rank is None and barrier is None
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        if barrier is not None:
            self.barrier = barrier
        elif distributed:
            self.barrier = lambda: comm.barrier(process_group)
        else:
            self.barrier = lambda: None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        return comm.broadcast_object(obj, group=self.group, group_src=0)

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        return comm.all_gather_object(obj, group=self.group)


class CheckpointManager:
    """Saves, verifies and loads ``global_step_<k>`` directories under ``root`` atomically, on one or many ranks.

    Every rank calls :meth:`save` with the same step; each rank runs the writer
    callbacks (SPMD code such as Megatron's dist checkpointing writes its shard
    from every rank) and its RNG state, rank 0 writes the trainer state; the
    ranks hash the files between them and rank 0 finalises. ``barrier`` defaults
    to ``torch.distributed.barrier`` on ``process_group`` when torch.distributed
    is initialised, else a no-op. :meth:`verify`, :meth:`resolve` and :meth:`save`
    are collective (every rank gets the same answer).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        verify: str = "full",
        rank: int | None = None,
        process_group: Any = None,
        barrier: Callable[[], None] | None = None,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be positive or null, got {max_to_keep}")
        if verify not in VERIFY_LEVELS:
            raise ValueError(f"trainer.checkpoint_verify must be one of {VERIFY_LEVELS}, got {verify!r}")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self.verify_level = verify
        self.group = _Group(rank, process_group, barrier)
        self.rank = self.group.rank
        self._barrier = self.group.barrier

    # ----------------------------------------------------------------- save
    def save(
        self,
        step: int,
        trainer_state: Mapping[str, Any],
        writers: Mapping[str, Writer] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` and make it the latest; returns its final directory.

        ``trainer_state`` (rank 0's is kept) must hold tensors and plain containers
        (dict/list/tuple/str/int/float/bool/None: it is loaded weights-only); ``writers``
        maps a subdirectory name to a callback run on every rank with that directory;
        ``config`` (optional) is stored as ``config.json`` for reference.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        writers = dict(writers or {})
        reserved = (COMPLETE_MARKER, TRAINER_STATE_FILE, mf.MANIFEST_FILE)
        for name in writers:
            if not name or "/" in name or name in reserved or name.startswith("."):
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

        manifest = self._hash_manifest(staging, step)
        if self.rank == 0:
            (staging / mf.MANIFEST_FILE).write_bytes(manifest)
            record = {"global_step": step, "time": time.time(), "format_version": FORMAT_VERSION,
                      "manifest": {mf.MANIFEST_FILE: mf.bytes_digest(manifest), "hash": mf.HASH_NAME}}
            _atomic_write_text(staging / COMPLETE_MARKER, json.dumps(record) + "\n")
            _fsync_dir(staging)
            if final.exists():  # re-saving a step (e.g. after resuming from it): retire the old copy first
                retired = self.root / f".old_{final.name}_{os.getpid()}"
                os.replace(final, retired)
                shutil.rmtree(retired)
            os.replace(staging, final)
            _fsync_dir(self.root)
            _atomic_write_text(self.root / LATEST_FILE, f"{step}\n")
            try:
                self._apply_retention()
            except OSError as exc:  # never fail a complete save (and strand the other ranks) over a cleanup
                print(f"warning: checkpoint retention under {self.root} failed: {exc}", file=sys.stderr, flush=True)
        self._barrier()  # nobody reads or moves on before the rename is done
        return final

    def _hash_manifest(self, staging: Path, step: int) -> bytes:
        """Every rank hashes its share of the staged files; the manifest document (meaningful on rank 0)."""
        exclude = (COMPLETE_MARKER, mf.MANIFEST_FILE)
        if self.group.distributed:  # one listing, rank 0's, so every rank splits the same set
            sizes = self.group.broadcast(mf.list_files(staging, exclude) if self.rank == 0 else None)
        else:
            sizes = mf.list_files(staging, exclude)
        mine = mf.shares(sizes, self.group.world_size)[self.group.rank if self.group.distributed else 0]
        files: dict[str, Any] = {}
        for part in self.group.all_gather(mf.hash_files(staging, mine)):
            files.update(part)
        return mf.manifest_bytes(files, step)

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
        if len(complete) <= self.max_to_keep:
            return
        # Count only checkpoints that pass the size check: a damaged newer one never pushes out the last good
        # one. Newest first, reading only until one good checkpoint more than max_to_keep is found.
        good: list[int] = []
        for step, path in reversed(complete):
            if not self._problems(path, full=False, local=True):
                good.append(step)
                if len(good) > self.max_to_keep:
                    break
        if len(good) <= self.max_to_keep:
            return
        oldest_kept = good[self.max_to_keep - 1]
        for step, path in complete:
            if step < oldest_kept:
                # Un-mark first so a crash mid-delete leaves an ignored directory, never a half one that counts.
                (path / COMPLETE_MARKER).unlink()
                shutil.rmtree(path, ignore_errors=True)

    # ----------------------------------------------------------------- verify
    def verify(self, path: str | os.PathLike, *, full: bool | None = None) -> list[str]:
        """Problems of checkpoint ``path`` against its manifest (empty: it verifies); collective.

        ``full`` (default: ``verify="full"`` at construction) re-hashes every byte, split across
        ranks; otherwise presence and sizes only. Every rank returns the same list.
        """
        full = self.verify_level == "full" if full is None else full
        return self._problems(Path(path), full=full, local=False)

    def _problems(self, path: Path, *, full: bool, local: bool) -> list[str]:
        """Sorted problems of ``path``; with ``local`` (rank 0's retention) no collectives, else agreed by all."""
        collective = not local and self.group.distributed
        head = self._read_head(path) if (not collective or self.rank == 0) else None
        if collective:
            head = self.group.broadcast(head)  # one reading of marker and manifest, rank 0's
        files, problem = head
        if files is None:
            return [problem]
        world = self.group.world_size if collective else 1
        me = self.group.rank if collective else 0
        mine = mf.shares({n: _entry_size(e) for n, e in files.items()}, world)[me]
        problems = mf.check_files(path, files, mine, full=full)
        if me == 0:
            try:
                problems += mf.unexpected_files(path, files, exclude=(COMPLETE_MARKER, mf.MANIFEST_FILE))
            except OSError as exc:
                problems.append(f"directory unreadable ({exc})")
        if collective:
            problems = [p for part in self.group.all_gather(problems) for p in part]
        return sorted(problems)

    @staticmethod
    def _read_head(path: Path) -> tuple[dict[str, Any] | None, str]:
        """``(manifest files, "")`` or ``(None, problem)`` from the marker and the manifest."""
        try:
            if not is_complete(path):
                return None, f"{COMPLETE_MARKER}: missing (the save never finished)"
            digest = (read_marker(path).get("manifest") or {}).get(mf.MANIFEST_FILE)
            files, problem = mf.read_manifest(path, digest)
        except OSError as exc:
            return None, f"unreadable ({exc})"
        return (files, "") if files is not None else (None, problem or "manifest unreadable")

    def resolve(self, resume_mode: str, resume_from_path: str | None = None) -> Path | None:
        """Which verified checkpoint to resume from, per ``trainer.resume_mode``; collective.

        ``auto``: the newest complete checkpoint under ``root`` that verifies; a newer one that
        fails is skipped with one warning naming its first bad file (none verifies: a
        :class:`CheckpointError`, since starting over would silently drop the run). ``disable``:
        None. ``resume_path``: ``resume_from_path``; anything else is itself a checkpoint path;
        an explicit path that is incomplete or fails verification is a :class:`CheckpointError`.
        """
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            candidates = self.group.broadcast(list_complete(self.root) if self.rank == 0 else None)
            failed: list[str] = []
            for _, path in reversed(candidates):
                problems = self.verify(path)
                if not problems:
                    return path
                failed.append(f"{path.name}/{summarize(problems)}")
                if self.rank == 0:  # one line, not a logging record too
                    print(f"warning: checkpoint {path} fails verification: {summarize(problems)}; "
                          "falling back to an older checkpoint", file=sys.stderr, flush=True)
            if failed:
                raise CheckpointError(
                    "trainer.resume_mode",
                    f"auto: no checkpoint under {self.root} verifies ({'; '.join(failed)}): move the damaged "
                    "ones away, or set trainer.resume_mode=disable to start over",
                )
            return None
        explicit = resume_from_path if resume_mode == "resume_path" else resume_mode
        field = "trainer.resume_from_path" if resume_mode == "resume_path" else "trainer.resume_mode"
        if not explicit:
            raise CheckpointError("trainer.resume_from_path", "resume_mode=resume_path needs trainer.resume_from_path")
        path = Path(explicit)
        if not self.group.broadcast(is_complete(path) if self.rank == 0 else None):
            raise CheckpointError(
                field,
                f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker); "
                f"complete ones under its parent: {[str(p) for _, p in list_complete(path.parent)]}",
            )
        problems = self.verify(path)
        if problems:
            raise CheckpointError(field, f"{path} fails verification: {summarize(problems)}; resume from another checkpoint")
        return path

    # ----------------------------------------------------------------- load
    def latest(self) -> Path | None:
        return find_latest(self.root)

    def load(
        self,
        path: str | os.PathLike,
        readers: Mapping[str, Writer] | None = None,
        restore_rng: bool = True,
    ) -> LoadedCheckpoint:
        """Read a complete checkpoint: trainer state, this rank's RNG state, then each reader on its subdir.

        Call :meth:`resolve` (or :meth:`verify`) first: ``load`` checks the format, not the bytes.
        """
        path = Path(path)
        if not is_complete(path):
            raise CheckpointError("trainer.resume_from_path", f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
        blob = _load_weights_only(path / TRAINER_STATE_FILE)
        if not isinstance(blob, dict) or blob.get("format_version") != FORMAT_VERSION:
            version = blob.get("format_version") if isinstance(blob, dict) else None
            raise CheckpointError(
                "trainer.resume_from_path",
                f"{path}: checkpoint format {version} is not {FORMAT_VERSION} (written by another version); "
                "start over with trainer.resume_mode=disable",
            )
        rng_state = None
        if restore_rng:
            rng_file = path / f"rng_state_rank{self.rank}.pt"
            if not rng_file.is_file():
                raise FileNotFoundError(
                    f"{rng_file} missing: the checkpoint was written by fewer ranks; pass restore_rng=False "
                    "to resume with fresh RNG streams"
                )
            rng_state = _load_weights_only(rng_file)
        for name, read in (readers or {}).items():
            sub = path / name
            if not sub.is_dir():
                raise FileNotFoundError(f"{path} has no '{name}' part; it holds {sorted(p.name for p in path.iterdir())}")
            read(sub)
        if rng_state is not None:  # last: nothing the readers do can move the restored streams
            restore_rng_state(rng_state)
        return LoadedCheckpoint(path=path, global_step=int(blob["global_step"]), trainer_state=blob["state"])
