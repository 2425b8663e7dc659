"""What a dist-checkpoint save costs with megatron's write-results Manager and with ``save_results_in_process``.

Two gloo ranks (re-launched under torchrun) save ``--mb`` MB of sharded fp32 tensors ``--saves`` times per arm
with ``megatron_core.dist_checkpointing.save``, as ``save_worker`` does:

* a warm-up save with every patch applied (torch's checkpoint modules imported, thread pools made: what any
  first save pays, whichever arm runs first);
* ``megatron (spawned Manager)``: the patch reverted, so the first save makes megatron's results queue from a
  ``multiprocessing`` spawn-context ``Manager`` (a new interpreter that re-imports this script);
* ``in-process queue (ours)``: the patch applied again.

It prints, per arm, the first save, the median of the later ones and the processes the arm left running per
rank, and the ratio of the first saves. Usage: ``python bench/checkpoint_save.py [--mb 16] [--saves 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._ranks import init_cpu_ranks, relaunched  # noqa: E402

PATCH = "save_results_in_process"


def _saves(root: Path, tag: str, mb: int, count: int) -> tuple[list[float], int]:
    """``count`` saves into fresh directories under ``root``; their times and the processes started meanwhile."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    n = mb * (1 << 20) // 4 // world
    state = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(n // 4), (0, rank, world)) for i in range(4)}
    before = {p.pid for p in multiprocessing.active_children()}
    times = []
    for i in range(count):
        path = root / f"{tag}{i}"
        if rank == 0:
            path.mkdir(parents=True)
        dist.barrier()
        start = time.perf_counter()
        dist_checkpointing.save(state, str(path))
        dist.barrier()
        times.append(time.perf_counter() - start)
    started = [p for p in multiprocessing.active_children() if p.pid not in before]
    return times, len(started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=16, help="checkpoint size over both ranks")
    parser.add_argument("--saves", type=int, default=3, help="saves per arm")
    args = parser.parse_args(argv)
    if relaunched(__file__, argv):
        return
    init_cpu_ranks()
    import torch.distributed as dist

    import megatron_patches

    root = Path(os.environ.get("BENCH_DIR") or tempfile.gettempdir()) / f"ckpt_save_bench_{os.environ['TORCHELASTIC_RUN_ID']}"
    _saves(root, "warmup", args.mb, 1)
    megatron_patches.revert([PATCH])
    theirs, theirs_procs = _saves(root, "megatron", args.mb, args.saves)
    megatron_patches.apply([PATCH])
    ours, ours_procs = _saves(root, "ours", args.mb, args.saves)
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        print(f"\ndist-checkpoint save, {args.mb} MB over 2 gloo ranks, {args.saves} saves per arm")
        print(f"{'arm':<28} {'first save s':>13} {'later saves s':>14} {'processes left':>15}")
        for name, times, procs in (("megatron (spawned Manager)", theirs, theirs_procs),
                                   ("in-process queue (ours)", ours, ours_procs)):
            later = statistics.median(times[1:]) if len(times) > 1 else float("nan")
            print(f"{name:<28} {times[0]:>13.2f} {later:>14.2f} {procs:>15}")
        print(f"first save: {theirs[0] / ours[0]:.1f}x faster in-process")
    dist.barrier()


if __name__ == "__main__":
    main()
