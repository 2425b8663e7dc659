"""Separate vs colocated placement at equal ranks, on a long-tail agent workload: the real trainer, engines and links.

The default task (a tool call, then the answer) with the meter's latency log-normal (``--median-s``, ``--sigma``,
capped at ``--max-s``: ``bench/_latency_tool.py``), so an episode's wall time is mostly its environment's and a few
episodes take many times the median — the long tail of agent RL. Three runs of ``--steps`` RL steps on
``--ranks`` ranks each, side by side:

* **colocated**: every rank trains and generates in turn (each step waits for its slowest episode);
* **colocated + partial**: ``rollout.partial_rollout`` with one assistant turn per round and a batch of prompts
  over-sampled, so a step trains the groups that completed and the slow ones go on in later steps;
* **separate**: ``--ranks - 1`` ranks train, one generates (``rollout.placement=separate``, ``max_staleness=1``).

Per run: trajectories trained per second over the RL steps, the trainer's idle fraction (the step's wait for its
rows over the step), the rollout side's idle fraction (colocated: the engines sleep while the model trains; separate:
the rollout rank's own count of the time it waited for the trainer), the staleness of the trained rows (versions:
count of rows by age), and lost / duplicated trajectories from the dumps (every trained row a distinct request).

The CPU's cores are shared by every rank: the workload's time is the environment's (sleeps), so the comparison is
the scheduling's, not the hardware's.

    python bench/disaggregated.py [--steps 10] [--ranks 3] [--median-s 0.3] [--sigma 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOOLS = """tools:
  - class_name: bench._latency_tool.SlowMeterTool
    config: {{median_s: {median}, sigma: {sigma}, max_s: {max_s}}}
    tool_schema:
      type: function
      function:
        name: read_meter
        description: Read the meter.
        parameters:
          type: object
          properties: {{}}
          required: []
"""


def run(name: str, nproc: int, overrides: list[str], args: argparse.Namespace, out: Path, tools: Path) -> dict:
    from mcore_agentic.feed.rollout_dump import read_dump

    log = out / name
    cmd = [sys.executable, "launch/pretrain_rl.py", "--nproc_per_node", str(nproc),
           f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
           f"trainer.log_dir={log / 'logs'}", f"trainer.default_local_dir={log / 'ckpt'}", "trainer.save_freq=-1",
           f"trainer.rollout_data_dir={log / 'rollouts'}", "trainer.rollout_data_freq=1",
           "trainer.rollout_data_fraction=1.0", "trainer.progress_bar=false", "trainer.plot_at_end=false",
           "trainer.logger=[jsonl]", f"rollout.multi_turn.tool_config_path={tools}",
           f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
           "actor.ppo_micro_batch_size_per_gpu=4", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (log / "logs" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 1]
    step_s = sum(r["timing_s/step"] for r in rows)
    wait_s = sum(r["timing_s/gen"] for r in rows)
    trained = [r for r in read_dump(log / "rollouts").to_pylist() if r["split"] == "train"]
    ids = [r["request_id"] for r in trained]
    ages = Counter()
    for r in rows:
        for key, value in r.items():
            if key.startswith("rollout/staleness_rows_"):
                ages[int(key.rsplit("_", 1)[1])] += int(value)
    rollout_idle = (sum(r.get("rollout/idle_fraction", 0.0) for r in rows) / len(rows)
                    if "separate" in name else 1 - wait_s / step_s)
    return {"wall_s": wall, "step_s": step_s, "trajectories": len(trained), "per_s": len(trained) / step_s,
            "trainer_idle": wait_s / step_s, "rollout_idle": rollout_idle, "ages": dict(sorted(ages.items())),
            "duplicated": len(ids) - len(set(ids)), "expected": args.steps * args.prompts * args.n,
            "reward": sum(r["reward/mean"] for r in rows) / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12, help="data.train_batch_size (prompt groups a step trains)")
    ap.add_argument("--n", type=int, default=4, help="rollout.n")
    ap.add_argument("--median-s", type=float, default=0.3)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-s", type=float, default=8.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_disaggregated_") as tmp:
        out = Path(tmp)
        tools = out / "tools.yaml"
        tools.write_text(TOOLS.format(median=args.median_s, sigma=args.sigma, max_s=args.max_s))
        common = [f"rollout.n={args.n}"]
        results = {
            "colocated": run("colocated", args.ranks, common, args, out, tools),
            "colocated + partial": run("colocated_partial", args.ranks, [
                *common, "rollout.partial_rollout.enable=true", "rollout.partial_rollout.max_turns_per_step=1",
                "rollout.partial_rollout.over_sampling_batches=1"], args, out, tools),
            "separate": run("separate", args.ranks, [
                *common, "rollout.placement=separate", "rollout.rollout_ranks=1", "rollout.max_staleness=1"],
                args, out, tools),
        }
    base = results["colocated"]["per_s"]
    print(f"default task, tool latency log-normal (median {args.median_s} s, sigma {args.sigma}, cap {args.max_s} s); "
          f"{args.steps} RL steps of {args.prompts} x {args.n} trajectories on {args.ranks} ranks, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'placement':<22} {'traj/s':>7} {'ratio':>6} {'trainer idle':>12} {'rollout idle':>12} "
          f"{'rows by age':<22} {'lost':>4} {'dup':>4} {'reward':>6}")
    for name, m in results.items():
        lost = m["expected"] - m["trajectories"]
        ages = " ".join(f"{k}:{v}" for k, v in m["ages"].items()) or "0:all"
        print(f"{name:<22} {m['per_s']:>7.2f} {m['per_s'] / base:>5.2f}x {m['trainer_idle']:>12.0%} "
              f"{m['rollout_idle']:>12.0%} {ages:<22} {lost:>4} {m['duplicated']:>4} {m['reward']:>6.3f}")


if __name__ == "__main__":
    main()
