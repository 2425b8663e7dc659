"""Actor throughput on CPU: tokens/s of ``compute_log_prob`` and ``update_policy`` at TP=1 vs TP=2.

Builds the ~100M-parameter ``100m`` tiny preset (Qwen2 architecture) with the
same builders the trainer uses (``make_tiny_hf_model_from_preset`` ->
``Actor``), then on 2 gloo ranks runs each layout in turn (TP=1 is DP=2, TP=2 is
DP=1): one warm-up, then ``--steps`` timed forward passes and PPO updates over a
random batch. Prints a table and the TP=2 / TP=1 throughput ratio (measured in
this run). MFU is only meaningful on a GPU and is not reported here.

    python bench/train_step.py                    # re-launches itself with torchrun, 2 ranks
    torchrun --nproc_per_node 2 bench/train_step.py --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._ranks import init_cpu_ranks, relaunched  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="100m", help="tiny-model preset (mcore_agentic.models.tiny.TINY_PRESETS)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--response", type=int, default=192, help="response tokens per sequence")
    p.add_argument("--micro", type=int, default=2, help="micro-batch size per rank")
    p.add_argument("--steps", type=int, default=2, help="timed steps per phase")
    p.add_argument("--layouts", default="1,2", help="comma-separated TP sizes to compare (first is the baseline)")
    p.add_argument("--model-dir", default="", help="reuse/create the checkpoint here (default: a temp dir)")
    return p.parse_args(argv)


def _batch(n: int, prompt: int, response: int, vocab: int, seed: int = 0):
    from mcore_agentic.data.batch import Batch, build_rollout_layout

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (n, prompt), generator=g)
    responses = torch.randint(1, vocab, (n, response), generator=g)
    advantages = torch.randn(n, response, generator=g)
    fields = {"response_mask": (torch.ones(n, response, dtype=torch.long), torch.long),
              "advantages": (advantages, torch.float32)}
    return Batch(build_rollout_layout(prompts, responses, pad_token_id=0, response_fields=fields))


def _run_layout(tp: int, model_dir: str, a: argparse.Namespace) -> dict[str, float]:
    import torch.distributed as dist

    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig

    par = ParallelConfig(tensor_model_parallel_size=tp)
    layout = initialize_parallel(par, seed=1)
    cfg = ActorConfig(
        parallel=par, ppo_mini_batch_size=a.batch, ppo_micro_batch_size_per_gpu=a.micro, shuffle=False,
        optim=OptimConfig(lr=1e-6),
    )
    actor = Actor(cfg, mini_batch_sequences=a.batch, model_path=model_dir, dtype="float32", layout=layout)
    batch = _batch(a.batch, a.prompt, a.response, actor.engine.vocab_size)
    tokens = int(batch["attention_mask"].sum())  # the step's, over every replica
    batch = batch.chunk(layout.data_parallel_size)[layout.dp_rank]  # each replica trains its rows
    batch = actor.compute_log_prob(batch)  # warm-up (and the old log-probs the update needs)
    actor.update_policy(batch)

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        for _ in range(a.steps):
            fn()
        dist.barrier()
        return (time.perf_counter() - t) / a.steps

    fwd = timed(lambda: actor.compute_log_prob(batch))
    upd = timed(lambda: actor.update_policy(batch))
    params = sum(p.numel() for p in actor.engine.chunks[0].parameters())
    actor = None  # free this layout's model before the next one is built
    destroy_parallel()
    return {"tp": tp, "dp": layout.data_parallel_size, "params_per_rank": params, "tokens": tokens,
            "fwd_s": fwd, "upd_s": upd, "fwd_tok_s": tokens / fwd, "upd_tok_s": tokens / upd}


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if relaunched(__file__, argv):
        return
    init_cpu_ranks()
    import torch.distributed as dist

    model_dir = a.model_dir or os.path.join(tempfile.gettempdir(), f"mcore_agentic_bench_{a.preset}")
    if dist.get_rank() == 0 and not (Path(model_dir) / "config.json").is_file():
        from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset

        make_tiny_hf_model_from_preset(model_dir, a.preset)
    dist.barrier()
    rows = [_run_layout(int(tp), model_dir, a) for tp in a.layouts.split(",")]
    if dist.get_rank() == 0:
        print(f"\nactor on CPU, {a.preset}, batch {a.batch} x {a.prompt}+{a.response} tokens, "
              f"micro {a.micro}/rank, {dist.get_world_size()} gloo ranks, fp32, {a.steps} timed steps")
        print(f"{'TP':>3} {'DP':>3} {'params/rank':>12} {'log-prob s':>11} {'log-prob tok/s':>15} "
              f"{'update s':>9} {'update tok/s':>13}")
        for r in rows:
            print(f"{r['tp']:>3} {r['dp']:>3} {r['params_per_rank']:>12,} {r['fwd_s']:>11.2f} {r['fwd_tok_s']:>15.1f} "
                  f"{r['upd_s']:>9.2f} {r['upd_tok_s']:>13.1f}")
        base = rows[0]
        for r in rows[1:]:
            print(f"TP={r['tp']} / TP={base['tp']} throughput: log-prob {r['fwd_tok_s'] / base['fwd_tok_s']:.2f}x, "
                  f"update {r['upd_tok_s'] / base['upd_tok_s']:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
