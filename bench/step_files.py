"""How many of the package's files one default GRPO step runs code in: this tree vs a baseline tree, side by side.

A newcomer following a step reads every file with a function the step executes. The worker runs the default job
(2 gloo ranks, two RL steps, no warm start, no validation) from a tree's own ``launch/pretrain_rl.py``, with
``sys.setprofile`` and ``threading.setprofile`` on during the second step on rank 0 (from drawing its prompts to
the end of ``RLTrainer.train_step``; a tree whose loop drew them before calling it is profiled from the draw), and
records the
files under the tree's ``mcore_agentic/`` whose functions were called, and how often the step came back to a file
it had left (on the step's own thread; the rollout's worker threads interleave). Prints a table per tree and the ratio against the baseline.

    python bench/step_files.py                               # this tree only
    git worktree add /tmp/base <rev> && python bench/step_files.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILED_STEP = 2
"""The step profiled: the second, past what the first step does once (schema and validator caches, warm-ups)."""


def _worker(tree: Path, out: Path) -> None:
    """Under torchrun: the tree's launcher with the first train_step profiled on rank 0."""
    sys.path.insert(0, str(tree))
    import runpy

    import torch.distributed as dist

    from mcore_agentic.trainer.loop import RLTrainer

    package = str(tree / "mcore_agentic") + os.sep
    calls: list[str] = []
    lock = threading.Lock()

    main = threading.main_thread()

    def profile(frame, event, arg):  # noqa: ANN001 -- sys.setprofile's signature
        if event == "call" and frame.f_code.co_filename.startswith(package):
            with lock:
                calls.append([frame.f_code.co_filename[len(package):], threading.current_thread() is main,
                              frame.f_code.co_name])

    state = {"steps": 0, "on": False}

    def start() -> None:
        if dist.get_rank() == 0 and state["steps"] == PROFILED_STEP - 1 and not state["on"]:
            state["on"] = True
            threading.setprofile(profile)
            sys.setprofile(profile)

    def stop() -> None:
        state["steps"] += 1
        if state["on"]:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            state["on"] = False
            out.write_text(json.dumps(calls))

    step = RLTrainer.train_step

    def profiled(self, *args, **kwargs):  # noqa: ANN001, ANN202
        start()
        try:
            return step(self, *args, **kwargs)
        finally:
            stop()

    try:  # before the feed, the loop drew the step's prompts before calling train_step: count the draw too
        from mcore_agentic.trainer.collect import RolloutCollector

        draw = RolloutCollector.next_prompts

        def profiled_draw(self, *args, **kwargs):  # noqa: ANN001, ANN202
            start()
            return draw(self, *args, **kwargs)

        RolloutCollector.next_prompts = profiled_draw
    except ImportError:
        pass

    RLTrainer.train_step = profiled
    sys.argv = [str(tree / "launch" / "pretrain_rl.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


def measure(tree: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calls.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree), "STEP_FILES_TREE": str(tree),
               "STEP_FILES_OUT": str(out)}
        overrides = [
            "trainer.total_training_steps=2", "trainer.sft_warmup_steps=0", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[console]",
            "trainer.progress_bar=false", "trainer.plot_at_end=false", "trainer.resume_mode=disable",
            f"trainer.log_dir={tmp}/logs", f"trainer.default_local_dir={tmp}/ckpt",
        ]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).resolve()), *overrides]
        run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        if not out.exists():
            raise SystemExit(f"{tree}: the step was not profiled (exit {run.returncode}):\n{run.stderr[-3000:]}")
        calls = json.loads(out.read_text())
    files = Counter(f for f, _, _ in calls)
    returns, seen, last = 0, set(), None
    for f in (f for f, on_main, _ in calls if on_main):  # the step's own thread: how often it comes back to a file
        if f != last:
            if f in seen:
                returns += 1
            seen.add(f)
            last = f
    main_files = {f for f, on_main, _ in calls if on_main}
    return {"tree": str(tree), "files": len(files), "main_thread_files": len(main_files), "returns": returns,
            "calls": len(calls),
            "by_package": Counter(f.split(os.sep)[0] for f in files), "list": sorted(files),
            "functions": sorted({f"{f}::{name}" for f, _, name in calls})}


def main(argv: list[str] | None = None) -> None:
    if "STEP_FILES_OUT" in os.environ:  # the torchrun worker
        _worker(Path(os.environ["STEP_FILES_TREE"]), Path(os.environ["STEP_FILES_OUT"]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="a checkout of the baseline revision (git worktree add)")
    a = p.parse_args(argv)
    rows = [measure(a.baseline.resolve())] if a.baseline else []
    rows.append(measure(ROOT))
    print(f"\n{'tree':<40} {'files':>6} {'returns':>8} {'calls':>9}  files per package")
    for r in rows:
        packages = ", ".join(f"{k} {v}" for k, v in sorted(r["by_package"].items()))
        print(f"{r['tree']:<40} {r['files']:>6} {r['returns']:>8} {r['calls']:>9}  {packages}")
    if a.baseline:
        print(f"\nfiles: {rows[1]['files']} / {rows[0]['files']} = {rows[1]['files'] / rows[0]['files']:.2f} of the baseline")


if __name__ == "__main__":
    main()
