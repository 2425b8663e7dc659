"""What a checkpoint manifest costs: hashing a 1 GB checkpoint with BLAKE3 against reading it, SHA-256 and CRC32.

Writes ``--files`` files totalling ``--gb`` GB of random bytes (a stand-in for a dist
checkpoint's ``__<rank>_<i>.distcp`` shards) into ``--dir``, then times, interleaved and
best of ``--repeats`` (the machine is noisy):

* ``read only``: every byte read in 8 MiB chunks and discarded (the floor any check pays);
* ``blake3 (ours)``: :func:`mcore_agentic.trainer.manifest.hash_files` (memory-mapped, threads);
* ``blake3, 1 thread``, ``sha256``, ``crc32`` (8 MiB chunks): the alternatives;
* ``save: torch.save``: writing the same bytes as one tensor per file, for scale: what a save
  costs before the manifest is added.

The files were just written, so they sit in the page cache, as at the end of a save; with
``--cold`` the cache is dropped before each timing (root only), as on a resume after a restart.
Usage: ``python bench/checkpoint_manifest.py [--gb 1] [--files 8] [--repeats 3] [--cold]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import blake3
import torch

from mcore_agentic.trainer import manifest as mf

CHUNK = 8 << 20


def _chunks(path: Path):
    with open(path, "rb", buffering=0) as f:
        while block := f.read(CHUNK):
            yield block


def read_only(paths: list[Path]) -> None:
    for p in paths:
        for _ in _chunks(p):
            pass


def blake3_ours(paths: list[Path]) -> None:
    mf.hash_files(paths[0].parent, [p.name for p in paths])


def _streamed(new_hash):
    """A method hashing every file in 8 MiB reads with ``new_hash()`` (anything with update/hexdigest)."""

    def run(paths: list[Path]) -> None:
        for p in paths:
            h = new_hash()
            for block in _chunks(p):
                h.update(block)
            h.hexdigest()

    return run


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, block: bytes) -> None:
        self.value = zlib.crc32(block, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


blake3_one_thread = _streamed(blake3.blake3)
sha256 = _streamed(hashlib.sha256)
crc32 = _streamed(_Crc32)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each timing (root)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    per_file = int(args.gb * 1e9) // args.files
    total = per_file * args.files
    try:
        tensors = [torch.randint(0, 256, (per_file,), dtype=torch.uint8) for _ in range(args.files)]
        paths = [root / f"__{i}_0.distcp" for i in range(args.files)]
        for p, t in zip(paths, tensors):
            p.write_bytes(t.numpy().tobytes())
        save_dir = root / "save"
        save_dir.mkdir()

        def torch_save(_: list[Path]) -> None:
            for i, t in enumerate(tensors):
                torch.save(t, save_dir / f"{i}.pt")
            os.sync()

        methods = {
            "read only": read_only,
            "blake3 (ours)": blake3_ours,
            "blake3, 1 thread": blake3_one_thread,
            "sha256": sha256,
            "crc32": crc32,
            "save: torch.save + sync": torch_save,
        }
        cold = args.cold and drop_caches()
        best = {name: float("inf") for name in methods}
        for _ in range(args.repeats):
            for name, fn in methods.items():
                if cold:
                    drop_caches()
                start = time.perf_counter()
                fn(paths)
                best[name] = min(best[name], time.perf_counter() - start)
        cache = "cold (dropped before each timing)" if cold else "warm (just written)"
        print(f"{total / 1e9:.2f} GB in {args.files} files, page cache {cache}, best of {args.repeats}, "
              f"{os.cpu_count()} CPUs")
        print(f"{'method':<26}{'seconds':>9}{'GB/s':>8}{'x read':>9}")
        for name, seconds in best.items():
            print(f"{name:<26}{seconds:>9.3f}{total / 1e9 / seconds:>8.2f}{seconds / best['read only']:>9.2f}")
        print(f"manifest (blake3) / torch.save of the same bytes: {best['blake3 (ours)'] / best['save: torch.save + sync']:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
