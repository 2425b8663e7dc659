"""Colocated vs separate rollout placement on the real default job, side by side in one run.

Runs ``launch/pretrain_rl.py`` twice on this machine: colocated on ``--trainer-ranks`` ranks, then separate with the
same trainer ranks plus ``--rollout-ranks`` generating (``rollout.placement=separate``), each for ``--steps`` RL
steps, and reads their ``metrics.jsonl``. Prints per placement: the mean step time, how long the trainer waited for
its rows (``timing_s/gen``: the whole rollout when colocated, only what was not ready when separate), the staleness
of the trained rows, greedy validation accuracy at the start and the end, and the step-time ratio.

On a machine with fewer cores than ranks the processes share the CPU: the figures then say whether generation
overlaps training (the trainer's wait) and what the staleness costs in learning, not the speed-up at equal GPUs.

    python bench/placement.py [--steps 40] [--trainer-ranks 2] [--rollout-ranks 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(name: str, nproc: int, overrides: list[str], steps: int, out: Path) -> dict[str, float]:
    log = out / name
    cmd = [sys.executable, "launch/pretrain_rl.py", "--nproc_per_node", str(nproc), *overrides,
           f"trainer.total_training_steps={steps}", f"trainer.log_dir={log / 'logs'}",
           f"trainer.default_local_dir={log / 'ckpt'}", "trainer.save_freq=-1", "trainer.rollout_data_dir=null",
           "trainer.progress_bar=false", "trainer.plot_at_end=false", "trainer.logger=[jsonl]"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (log / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if r["step"] > 1]  # step 1 has no overlap to show
    val = [r["val/reward/accuracy"] for r in rows if "val/reward/accuracy" in r]
    return {
        "wall_s": wall,
        "step_s": statistics.mean(r["timing_s/step"] for r in steps_),
        "wait_s": statistics.mean(r["timing_s/gen"] for r in steps_),
        "staleness": max((r.get("rollout/staleness_max", 0.0) for r in steps_), default=0.0),
        "val_first": val[0] if val else float("nan"),
        "val_last": val[-1] if val else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--trainer-ranks", type=int, default=2)
    ap.add_argument("--rollout-ranks", type=int, default=1)
    ap.add_argument("--max-staleness", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_placement_") as tmp:
        out = Path(tmp)
        t, r = args.trainer_ranks, args.rollout_ranks
        colocated = run("colocated", t, [], args.steps, out)
        separate = run("separate", t + r, ["rollout.placement=separate", f"rollout.rollout_ranks={r}",
                                           f"rollout.max_staleness={args.max_staleness}"], args.steps, out)
    print(f"default job, {args.steps} RL steps, {os.cpu_count()} CPU cores")
    print(f"{'placement':<30} {'step s':>8} {'waited s':>9} {'staleness':>9} {'val first':>9} {'val last':>9}")
    for name, m, ranks in (("colocated", colocated, f"{t} ranks"), ("separate", separate, f"{t} train + {r} generate")):
        print(f"{name + ' (' + ranks + ')':<30} {m['step_s']:>8.3f} {m['wait_s']:>9.3f} {m['staleness']:>9.0f} "
              f"{m['val_first']:>9.3f} {m['val_last']:>9.3f}")
    print(f"step time, colocated / separate: {colocated['step_s'] / separate['step_s']:.2f}x; trainer's wait for rows: "
          f"{colocated['wait_s'] / max(separate['wait_s'], 1e-9):.1f}x less when separate")


if __name__ == "__main__":
    main()
