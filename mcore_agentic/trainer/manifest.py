"""Checkpoint manifests: every file's size and BLAKE3 digest, written before ``COMPLETE``, checked before a resume.

A checkpoint directory is trusted only as far as its manifest. ``MANIFEST.json``
lists every regular file under the directory (relative path, size, BLAKE3
digest); the ``COMPLETE`` marker, written after it, records the manifest's own
digest. Verification (:func:`check_files`) finds what changed since the save:

* a missing file, a file of another size (truncation), a file whose bytes
  differ (zeroed or flipped blocks with the size unchanged), a file that is not
  in the manifest, a symlink;
* a manifest that is missing or altered (its digest is not the one in ``COMPLETE``);
* a torch.distributed.checkpoint ``.metadata`` file whose pickle names anything
  outside the checkpoint-metadata classes (torch unpickles that file without
  restrictions). Every other pickle on the resume path is weights-only: our trainer
  state and RNG files, megatron-core's ``common.pt`` (torch's default), and the byte
  entries inside ``.distcp`` shards, which torch would load with
  ``weights_only=False`` and the ``dist_checkpointing_weights_only`` megatron patch loads
  weights-only (:func:`~mcore_agentic.trainer.model_checkpoint.load_worker` refuses to load
  without it).

Hashing is split across ranks (:func:`shares`: files largest first, each to the
least-loaded rank), so a save or a check reads every byte once on the whole
job, not once per rank. BLAKE3 (the ``blake3`` package: SIMD and multi-threaded
on large files) hashes at memory speed; ``docs/benchmarks.md`` has its cost on a
1 GB checkpoint next to SHA-256 and CRC32.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import os
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import blake3

MANIFEST_FILE = "MANIFEST.json"
HASH_NAME = "blake3"
MANIFEST_FORMAT = 1


READ_CHUNK = 8 << 20


def file_digest(path: str | os.PathLike, *, mapped: bool = True) -> str:
    """BLAKE3 hex digest of a file's bytes, on several threads for large files.

    ``mapped``: hash the memory-mapped file in place (fastest on a file just written, in the page
    cache). Verification reads instead (``mapped=False``): an I/O error on a damaged disk is then an
    ``OSError`` to report, where a mapped page would raise SIGBUS and kill the process.
    """
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if mapped:
        if os.path.getsize(path):  # mmap of an empty file fails
            h.update_mmap(path)
        return h.hexdigest()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def bytes_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def list_files(root: str | os.PathLike, exclude: Iterable[str] = ()) -> dict[str, int]:
    """``{relative posix path: size}`` of every entry under ``root`` except ``exclude`` (top-level names).

    Symlinks are listed with size -1 (a checkpoint never holds one; verification refuses them).
    """
    root = Path(root)
    skip = set(exclude)
    found: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        for name in dirnames:
            if (Path(dirpath) / name).is_symlink():
                found[(rel_dir / name).as_posix()] = -1
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if rel in skip:
                continue
            path = Path(dirpath) / name
            found[rel] = -1 if path.is_symlink() else path.stat().st_size
    return dict(sorted(found.items()))


def shares(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Split files over ranks for hashing: largest first, each to the least-loaded rank (same on every rank)."""
    load = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[rank].append(name)
        load[rank] += max(size, 0)
    return out


def hash_files(root: str | os.PathLike, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "blake3"}}`` for ``names`` under ``root``."""
    root = Path(root)
    return {n: {"size": (root / n).stat().st_size, HASH_NAME: file_digest(root / n)} for n in names}


def manifest_bytes(files: Mapping[str, Mapping[str, Any]], step: int) -> bytes:
    """The manifest document (sorted keys: the same files give the same bytes)."""
    doc = {"format": MANIFEST_FORMAT, "hash": HASH_NAME, "global_step": step, "files": dict(sorted(files.items()))}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


# --------------------------------------------------------------------------------------------- checks
def read_manifest(path: Path, expected_digest: str | None) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """``(files, None)``, or ``(None, problem)`` when the manifest is missing, altered or unreadable."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return None, f"{MANIFEST_FILE}: missing (a checkpoint written before verified checkpoints, or a partial copy)"
    data = manifest.read_bytes()
    if expected_digest is None:
        return None, "COMPLETE: records no manifest digest (a checkpoint written before verified checkpoints)"
    if bytes_digest(data) != expected_digest:
        return None, f"{MANIFEST_FILE}: altered since the save (its digest is not the one COMPLETE records)"
    try:
        doc = json.loads(data)
        files = doc["files"]
        if doc.get("hash") != HASH_NAME or not isinstance(files, dict):
            raise ValueError(f"hash {doc.get('hash')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{MANIFEST_FILE}: unreadable ({exc})"
    return files, None


def check_files(
    path: Path, files: Mapping[str, Mapping[str, Any]], names: Iterable[str], *, full: bool
) -> list[str]:
    """Problems of ``names`` (entries of ``files``) under ``path``: presence, size and (``full``) digest."""
    problems = []
    for name in names:
        try:
            problem = _check_file(path / name, files[name], full=full)
        except (OSError, KeyError, TypeError, ValueError) as exc:  # an unreadable disk block, a bad entry
            problem = f"unreadable ({type(exc).__name__}: {exc})"
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _check_file(target: Path, entry: Mapping[str, Any], *, full: bool) -> str | None:
    if target.is_symlink():
        return "is a symlink; a checkpoint holds plain files only"
    if not target.is_file():
        return "missing"
    if (size := target.stat().st_size) != entry["size"]:
        return f"{size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
    if full and file_digest(target, mapped=False) != entry[HASH_NAME]:
        return "content differs from the save (checksum mismatch, size unchanged)"
    if target.name == ".metadata":
        return check_metadata_pickle(target)
    return None


def unexpected_files(path: Path, files: Mapping[str, Any], exclude: Iterable[str]) -> list[str]:
    """Entries under ``path`` that the manifest does not list (nothing should appear after a save)."""
    return [f"{name}: not in the manifest (added after the save)" for name in list_files(path, exclude) if name not in files]


# torch.distributed.checkpoint pickles its ``.metadata`` and unpickles it with ``pickle.load``: a file
# placed there could run code on resume. A real one refers to the checkpoint metadata's own classes
# (dataclasses and enums of these modules), torch.Size, dtypes, paths and a layout decoder; nothing callable else.
_METADATA_CLASS_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a plain dcp.save
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        # A dotted name (protocol 4) walks attributes from the module: "planner.torch.ctypes.CDLL" would
        # reach any class. Only names defined in the module itself, looked up in its namespace.
        if "." not in name:
            if (module, name) in _METADATA_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
                return vars(torch)[name]
            if module in _METADATA_CLASS_MODULES:
                found = vars(importlib.import_module(module)).get(name)
                is_record = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
                if is_record and found.__module__ == module:  # a dataclass or enum of that module, no function
                    return found
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


def check_metadata_pickle(path: Path) -> str | None:
    """None if ``path`` unpickles with checkpoint-metadata classes only, else why not."""
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        return f"its pickle {exc}, which a checkpoint's metadata never does: refusing to load it"
    except Exception as exc:  # noqa: BLE001 - truncated or garbage bytes
        return f"not a readable checkpoint metadata pickle ({type(exc).__name__}: {exc})"
    return None


__all__ = [
    "HASH_NAME",
    "MANIFEST_FILE",
    "bytes_digest",
    "check_files",
    "check_metadata_pickle",
    "file_digest",
    "hash_files",
    "list_files",
    "manifest_bytes",
    "read_manifest",
    "shares",
    "unexpected_files",
]
