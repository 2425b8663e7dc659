"""On-policy distillation against RL alone on the default job: does a student reach its teacher's accuracy sooner?

1. **The teacher**: a tiny Qwen2 of another size than the student (``--teacher-layers`` layers of hidden
   ``--teacher-hidden``, against the default job's 2 of 64; the same tokenizer), trained on the default task by the
   default job itself (``--teacher-steps`` RL steps after its warm start), then exported with
   ``launch/export_hf.py`` — what a user does with a model trained elsewhere.
2. **The students**, for each seed of ``--seeds``: the default job for ``--steps`` RL steps, once as it is (**RL
   alone**) and once per distillation arm with ``teacher.model_path`` set (``algorithm.distillation.mode``,
   ``coef`` and ``top_k``: the sampled-token advantage, or the KL over the teacher's top k as a loss).
   Same warm start, same prompts, same budget of steps; greedy validation every ``--test-freq`` steps.

Prints the validation accuracy by step for each arm (each seed and the mean), the teacher's own, and the first step
at which each arm's mean reaches the teacher's accuracy. Each run is ``python launch/pretrain_rl.py
--nproc_per_node 2`` (2 CPU ranks): about 3 minutes for the teacher and 1–2 per student run on this machine.

    python bench/distillation.py                       # 3 seeds, 20 steps
    python bench/distillation.py --seeds 1 --steps 10  # a quick look
    python bench/distillation.py --work outputs/bench_distill --reuse-teacher
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ACC = "val/reward/accuracy"


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench_distillation")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="RL steps of each student run")
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--teacher-steps", type=int, default=40)
    p.add_argument("--teacher-hidden", type=int, default=128)
    p.add_argument("--teacher-layers", type=int, default=4)
    p.add_argument("--teacher-lr", type=float, default=None,
                   help="the teacher run's actor.optim.lr (default: the default job's 3e-3)")
    p.add_argument("--reuse-teacher", action="store_true", help="keep an exported teacher from an earlier run")
    p.add_argument("--reuse-runs", action="store_true", help="keep the curves of student runs an earlier call finished")
    p.add_argument("--arms", default="rl,only:1.0,only:1.0:k8,add:1.0:k8",
                   help="comma-separated: rl (RL alone) and MODE:COEF[:kK] (distillation with algorithm.distillation.mode "
                        "MODE, coef COEF and, with kK, top_k K: the KL over the teacher's top K as a loss)")
    return p.parse_args(argv)


COMMON = ["trainer.rollout_data_dir=null", "trainer.plot_at_end=false", "trainer.logger=[jsonl]",
          "trainer.progress_bar=false"]


def _run(name: str, work: Path, overrides: list[str]) -> tuple[dict[int, float], float]:
    """One default-job run; its validation accuracy by step and its wall seconds."""
    logs = work / name
    cmd = [sys.executable, "launch/pretrain_rl.py", "--nproc_per_node", "2", *COMMON,
           f"trainer.log_dir={logs}", *overrides]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    acc = {}
    for line in (logs / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if ACC in row:
            acc[int(row["step"])] = float(row[ACC])
    print(f"  {name}: {seconds:.0f} s, validation {acc}", flush=True)
    return acc, seconds


def _teacher(a: argparse.Namespace) -> tuple[Path, dict[int, float]]:
    """Train the teacher on the task and export it; its path and validation curve."""
    from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset

    out = a.work / "teacher"
    curve_file = a.work / "teacher_curve.json"
    if a.reuse_teacher and (out / "config.json").is_file() and curve_file.is_file():
        return out, {int(k): v for k, v in json.loads(curve_file.read_text()).items()}
    base = a.work / "teacher_base"
    if not (base / "config.json").is_file():
        make_tiny_hf_model_from_preset(base, "tiny", hidden_size=a.teacher_hidden, num_hidden_layers=a.teacher_layers,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=2 * a.teacher_hidden, seed=11)
    ckpt = a.work / "teacher_ckpt"
    curve, _ = _run("teacher_train", a.work, [
        f"model.model_path={base}", f"trainer.total_training_steps={a.teacher_steps}", f"trainer.test_freq={a.teacher_steps}",
        f"trainer.save_freq={a.teacher_steps}", f"trainer.default_local_dir={ckpt}", "trainer.resume_mode=disable",
        *([f"actor.optim.lr={a.teacher_lr}"] if a.teacher_lr is not None else [])])
    done = subprocess.run([sys.executable, "launch/export_hf.py", "--checkpoint", str(ckpt / f"global_step_{a.teacher_steps}"),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"export failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    curve_file.write_text(json.dumps(curve))
    return out, curve


def _arm_overrides(arm: str, teacher: Path) -> list[str]:
    """``rl`` (the default job as it is) or ``MODE:COEF[:kK]`` (the same job distilling from the teacher)."""
    if arm == "rl":
        return []
    mode, coef, *rest = arm.split(":") + ([] if ":" in arm else ["1.0"])
    top_k = int(rest[0].lstrip("k")) if rest else 0
    return [f"teacher.model_path={teacher}", f"algorithm.distillation.mode={mode}",
            f"algorithm.distillation.coef={float(coef or 1.0)}", f"algorithm.distillation.top_k={top_k}"]


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    print(f"teacher: {a.teacher_layers} layers of hidden {a.teacher_hidden}, {a.teacher_steps} RL steps", flush=True)
    teacher, teacher_curve = _teacher(a)
    target = teacher_curve[max(teacher_curve)]
    names = [arm.strip() for arm in a.arms.split(",") if arm.strip()]
    arms: dict[str, list[dict[int, float]]] = {arm: [] for arm in names}
    seconds: dict[str, list[float]] = {arm: [] for arm in names}
    for seed in range(1, a.seeds + 1):
        student = [f"seed={seed}", f"trainer.total_training_steps={a.steps}", f"trainer.test_freq={a.test_freq}",
                   "trainer.save_freq=-1", f"trainer.default_local_dir={a.work / 'student_ckpt'}",
                   "trainer.resume_mode=disable"]
        for arm in names:
            run = f"{arm.replace(':', '_')}_seed{seed}"
            kept = a.work / run / "curve.json"
            if a.reuse_runs and kept.is_file():
                record = json.loads(kept.read_text())
                curve, s = {int(k): v for k, v in record["curve"].items()}, record["seconds"]
                print(f"  {run}: kept from an earlier run, validation {curve}", flush=True)
            else:
                curve, s = _run(run, a.work, [*student, *_arm_overrides(arm, teacher)])
                kept.write_text(json.dumps({"curve": curve, "seconds": s}))
            arms[arm].append(curve)
            seconds[arm].append(s)
    if not names or a.seeds < 1:
        return
    steps = sorted(set.intersection(*(set(c) for runs in arms.values() for c in runs)))
    print(f"\nthe default job (student: 2 layers of hidden 64), {a.seeds} seed(s), greedy validation accuracy on "
          f"32 readings; teacher ({a.teacher_layers}x{a.teacher_hidden}) after {a.teacher_steps} steps: {target:.3f}; "
          "arms: rl = RL alone, MODE:COEF = algorithm.distillation.mode and coef")
    print(f"{'step':>5} | " + " | ".join(f"{arm:>28}" for arm in arms))
    print("-" * (8 + 31 * len(arms)))
    for step in steps:
        cells = []
        for runs in arms.values():
            values = [c[step] for c in runs]
            cells.append(f"{statistics.mean(values):.3f} ({' '.join(f'{v:.2f}' for v in values)})".rjust(28))
        print(f"{step:>5} | " + " | ".join(cells))
    for arm, runs in arms.items():
        reached = next((s for s in steps if statistics.mean(c[s] for c in runs) >= target), None)
        each = [next((s for s in steps if c[s] >= target), None) for c in runs]
        print(f"{arm}: mean reaches the teacher's {target:.3f} at step {reached if reached is not None else '-'} "
              f"(each seed: {' '.join('-' if s is None else str(s) for s in each)}); "
              f"{statistics.mean(seconds[arm]):.0f} s per run")


if __name__ == "__main__":
    main()
