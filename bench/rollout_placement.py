"""Rollout placement for a tensor-parallel actor: one rollout per training replica vs per rollout group.

A TP=2 actor on 2 ranks is one training replica. Placing rollouts by training replica (the
baseline, what the trainer did before ``parallel/rollout_placement.py``) has both ranks
generate all of the replica's prompts with their own engine and keeps one copy; placing
them by rollout group (ours, ``rollout.tensor_model_parallel_size=1``) gives each rank's
engine a disjoint half. ``rollout TP=2`` (one engine on rank 0 for both ranks) is shown too:
the same work as the baseline with half the engines' memory.

Every mode runs the real driver and agent loop (``generate_sequences_sync``) with the
transformers engine over a tiny Qwen2 checkpoint, the calculator tool and the synthetic
tool task, on 2 gloo ranks; the step's rollout wall time is the slowest rank's.

    python bench/rollout_placement.py              # re-launches itself with torchrun, 2 ranks
    torchrun --nproc_per_node 2 bench/rollout_placement.py --prompts 16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._ranks import relaunched  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (global)")
    p.add_argument("--n", type=int, default=2, help="samples per prompt")
    p.add_argument("--response", type=int, default=64, help="response token budget")
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts per mode (the fastest is reported)")
    return p.parse_args(argv)


def _rollout_seconds(rows, engine, tools, executor, cfg, tok, repeats: int) -> float:
    """Fastest of ``repeats`` rollouts of ``rows`` on this rank (engine None: idle), slowest rank's time."""
    import torch.distributed as dist

    from mcore_agentic.rollout.driver import generate_sequences_sync

    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if engine is not None and rows:
            batch = generate_sequences_sync(rows, engine, tools, None, cfg, tok, executor)
            assert len(batch) == len(rows) * cfg.n and batch.info["rollout/failed_requests"] == 0, batch.info
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, float(elapsed))
    return best


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if relaunched(__file__, argv):
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from mcore_agentic.data.config import SyntheticTaskConfig
    from mcore_agentic.data.synthetic import make_rows
    from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset
    from mcore_agentic.parallel.layout import init_distributed
    from mcore_agentic.parallel.rollout_placement import RolloutPlacement
    from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
    from mcore_agentic.rollout.engines.hf import HFEngine
    from mcore_agentic.tools.executor import make_executor
    from mcore_agentic.tools.registry import load_tools

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir = Path(tempfile.gettempdir()) / "mcore_agentic_bench_tiny"
    if rank == 0 and not (model_dir / "config.json").is_file():
        make_tiny_hf_model_from_preset(model_dir, "tiny")
    dist.barrier()
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    executor = make_executor("local")
    tools = load_tools(str(ROOT / "configs/tools/calculator_tool_config.yaml"), executor=executor)
    rows, _ = make_rows(SyntheticTaskConfig(num_train=a.prompts, num_val=1))
    cfg = RolloutConfig(
        n=a.n, temperature=1.0, seed=0, prompt_length=512, response_length=a.response,
        multi_turn=MultiTurnConfig(max_assistant_turns=3, tool_config_path=None),
    )
    engine = HFEngine.from_pretrained(model_dir, seed=0)

    results = []
    # Baseline: both ranks of the TP=2 replica roll out all of its prompts.
    results.append(("per training replica (baseline)", world,
                    _rollout_seconds(rows, engine, tools, executor, cfg, tok, a.repeats)))
    for rollout_tp in (1, 2):
        place = RolloutPlacement(world, rank, rollout_tp)
        mine = place.split_rows(rows)
        seconds = _rollout_seconds(mine, engine if place.is_leader else None, tools, executor, cfg, tok, a.repeats)
        results.append((f"per rollout group, rollout TP={rollout_tp}", place.num_groups, seconds))
    if rank == 0:
        print(f"\nrollout of {a.prompts} prompts x n={a.n} ({a.prompts * a.n} trajectories, <= {a.response} response "
              f"tokens, calculator tool) for a TP=2 actor on {world} gloo ranks, tiny Qwen2, HF engine, best of {a.repeats}")
        print(f"{'placement':>34} {'engines':>8} {'wall s':>8} {'trajectories/s':>15}")
        for name, engines, seconds in results:
            print(f"{name:>34} {engines:>8} {seconds:>8.2f} {a.prompts * a.n / seconds:>15.1f}")
        print(f"speed-up per rollout group (rollout TP=1) vs per training replica: {results[0][2] / results[1][2]:.2f}x")
    executor.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
