"""The step's experience path: bytes received per rank and seconds, old (all-gather of pickled batches) vs new.

No model and no generation: each of 2 gloo ranks is a rollout leader holding a scored rollout of
``B / 2`` synthetic trajectories (log-normal lengths clipped to 32..2,048 tokens, ``rollout.n``-sized
prompt groups, chat messages and request metrics as the driver makes them). Then, at DP=2 (TP=1)
and at TP=2 (DP=1), in the same run:

* **old** — what the trainer did before: ``all_gather_object`` of every leader's whole scored
  ``Batch`` to every rank, then every rank re-pads the global batch;
* **new** — :mod:`mcore_agentic.feed.distribute`: the rollout statistics all-reduced, one
  all-gather of row lengths, the plan, and the point-to-point exchange of real-token tensors to
  the replica that trains them (plus its broadcast inside a TP replica).

Bytes received are counted by wrapping torch.distributed's collectives (pickled sizes for object
collectives, tensor bytes otherwise; what a rank gets from the others). Prints a table and the
new / old ratio per rank; at DP=2 the new path's bytes per rank follow the rank's share.

    python bench/data_path.py                     # re-launches itself with torchrun, 2 ranks
    python bench/data_path.py --batches 64,256
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._ranks import init_cpu_ranks, relaunched  # noqa: E402
from bench.packing import lognormal_lengths  # noqa: E402

RECEIVED = [0]


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,256,1024", help="global trajectories per step to compare")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions (the fastest is kept)")
    return p.parse_args(argv)


def _count_received() -> None:
    """Wrap the collectives the two paths use so each adds what this rank receives to RECEIVED."""
    import torch.distributed as dist

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def wrap(name, count):
        original = getattr(dist, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            out = original(*args, **kwargs)
            RECEIVED[0] += count(*args, **kwargs)
            return out

        setattr(dist, name, counted)

    me = lambda: dist.get_rank()  # noqa: E731
    wrap("all_gather_object", lambda out, obj, group=None: sum(len(pickle.dumps(o)) for o in out) - len(pickle.dumps(obj)))
    wrap("all_gather", lambda out, t, group=None, **k: sum(nbytes(o) for o in out) - nbytes(t))
    wrap("all_reduce", lambda t, *a, **k: nbytes(t))
    wrap("broadcast", lambda t, src=None, group=None, **k: 0 if src == me() else nbytes(t))
    wrap("batch_isend_irecv", lambda ops: sum(nbytes(op.tensor) for op in ops if op.op is dist.irecv))


def scored_rollout(rows: int, n: int, group: int, seed: int):
    """A leader's scored rollout as the driver and the reward step leave it (tensors and per-row objects)."""
    from mcore_agentic.data.batch import Batch, build_rollout_layout

    g = torch.Generator().manual_seed(seed)
    lengths = lognormal_lengths(rows, seed)
    prompt = 24
    prompts = [torch.randint(1, 4096, (prompt,), generator=g) for _ in lengths]
    responses = [torch.randint(1, 4096, (max(1, t - prompt),), generator=g) for t in lengths]
    fields = {
        "response_mask": ([torch.ones(len(r), dtype=torch.long) for r in responses], torch.long),
        "rollout_log_probs": ([-torch.rand(len(r), generator=g) for r in responses], torch.float32),
    }
    tensors = build_rollout_layout(prompts, responses, pad_token_id=0, response_fields=fields)
    tensors["seq_scores"] = torch.rand(rows, generator=g)
    text = lambda k: "x" * (4 * k)  # noqa: E731 - ~4 characters per token, as chat text runs
    meta = {
        "messages": [[{"role": "user", "content": text(prompt)}, {"role": "assistant", "content": text(len(r))}]
                     for r in responses],
        "uid": [f"{group}-{i // n}" for i in range(rows)],
        "data_source": ["synthetic"] * rows,
        "ground_truth": ["42"] * rows,
        "tool_rewards": [0.0] * rows,
        "interaction_scores": [[] for _ in range(rows)],
        "num_turns": [2] * rows,
        "finish_reason": ["stop"] * rows,
        "request_metrics": [{"assistant_turns": 1, "tool_calls": 0, "state": "completed"} for _ in range(rows)],
        "acc": [1.0] * rows,
        "rule_score": [1.0] * rows,
    }
    return Batch(tensors=tensors, meta=meta)


def old_path(local, pad_token_id: int = 0):
    """Before: every leader's whole batch to every rank (pickled), re-padded to common widths everywhere."""
    import torch.distributed as dist

    from mcore_agentic.data.batch import Batch, repad_rollout_layout

    objs: list = [None] * dist.get_world_size()
    dist.all_gather_object(objs, local)
    parts = [b for b in objs if b is not None]
    p = max(b["prompts"].shape[1] for b in parts)
    r = max(b["responses"].shape[1] for b in parts)
    return Batch.concat([Batch(repad_rollout_layout(b.tensors, pad_token_id=pad_token_id, prompt_width=p,
                                                    response_width=r), b.meta, b.info) for b in parts])


def new_path(local, placement, layout, rows_per_group: int, minis: list[int]):
    from mcore_agentic.feed import scoring as exp
    from mcore_agentic.feed.distribute import exchange_rows, gather_shapes, plan_step, tag_groups

    local = tag_groups(local, placement.group_index)
    exp.rollout_stats([local]).reduce(world=True)
    shapes = gather_shapes(local, placement, rows_per_group)
    plan = plan_step(shapes, layout.data_parallel_size, mini_batch_sizes=minis, seed=7)
    return exchange_rows(local, plan, layout, 0)


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if relaunched(__file__, argv):
        return
    init_cpu_ranks()
    import torch.distributed as dist

    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.parallel.rollout_placement import RolloutPlacement

    _count_received()
    rank, world = dist.get_rank(), dist.get_world_size()
    placement = RolloutPlacement(world, rank, 1)  # a rollout engine on each rank
    results = []
    for name, tp in (("DP=2", 1), ("TP=2", 2)):
        layout = initialize_parallel(ParallelConfig(tensor_model_parallel_size=tp), seed=1)
        for total in [int(b) for b in a.batches.split(",")]:
            rows = total // world
            local = scored_rollout(rows, a.n, placement.group_index, seed=total + rank)
            row = {"layout": name, "batch": total}
            for path in ("old", "new"):
                best, got = float("inf"), 0
                for _ in range(a.repeats):
                    dist.barrier()
                    RECEIVED[0] = 0
                    t = time.perf_counter()
                    out = old_path(local) if path == "old" else new_path(local, placement, layout, rows, [total // 4])
                    best = min(best, time.perf_counter() - t)
                    got = RECEIVED[0]
                row[f"{path}_bytes"], row[f"{path}_s"], row[f"{path}_rows"] = got, best, len(out)
            results.append(row)
        destroy_parallel()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print(f"\nexperience path on 2 gloo ranks (CPU), log-normal 32-2,048-token trajectories, rollout.n={a.n}, "
              f"two rollout leaders; bytes received per rank, best of {a.repeats}")
        print(f"{'layout':<6} {'batch':>6} {'rank':>4} {'rows held old/new':>18} {'old MiB':>9} {'new MiB':>9} "
              f"{'new/old bytes':>13} {'old s':>7} {'new s':>7} {'old/new time':>12}")
        for per_rank in zip(*gathered):
            for rk, r in enumerate(per_rank):
                print(f"{r['layout']:<6} {r['batch']:>6} {rk:>4} {r['old_rows']:>8}/{r['new_rows']:<9} "
                      f"{r['old_bytes'] / 2**20:>9.2f} {r['new_bytes'] / 2**20:>9.2f} "
                      f"{r['new_bytes'] / max(r['old_bytes'], 1):>13.3f} {r['old_s']:>7.3f} {r['new_s']:>7.3f} "
                      f"{r['old_s'] / max(r['new_s'], 1e-9):>11.1f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
