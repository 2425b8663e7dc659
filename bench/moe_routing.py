"""Routing replay on CPU: a bfloat16 rollout engine against an fp32 Megatron trainer on a Qwen3-MoE at EP=2.

Rank 0 writes a random Qwen3-MoE checkpoint (16 experts of 128, top-4, in each of 4 layers by default). Every
rank loads it into the transformers engine in bfloat16 with routing recorded (``record_routing``) and samples
the same completions of random prompts (same seeds); each rank trains half of them. The actor (fp32, experts
split over the 2 ranks) then scores the sampled tokens twice on the same rows: with its own routing
(``actor.moe.routing_replay=measure``) and replaying the engine's experts (``rollout``). Prints, per pass:

* ``routing agreement``: (token, MoE layer) pairs whose top-k set the trainer's router shares with the engine's;
* ``replayed``: pairs routed to the engine's experts in that pass (every fed token under replay);
* the max / mean ``|rollout - trainer|`` log-prob gap over the sampled tokens (the rest is bf16 vs fp32
  arithmetic), and the ratio replay / no replay;
* an fp32 engine row as the floor (same numerics as the trainer: the gap of the kernels alone).

    python bench/moe_routing.py                 # re-launches itself with torchrun, 2 ranks
    python bench/moe_routing.py --rows 32 --new-tokens 64 --layers 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._ranks import relaunched  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=128)
    p.add_argument("--rows", type=int, default=16, help="completions over both ranks")
    p.add_argument("--new-tokens", type=int, default=48)
    return p.parse_args(argv)


def _rollout(path: str, a: argparse.Namespace, dtype: torch.dtype):
    """The engine's completions of random prompts as rollout rows with ``routed_experts`` (every rank: all rows)."""
    from mcore_agentic.rollout.driver import sample_rows
    from mcore_agentic.rollout.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(path, dtype=dtype, record_routing=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 4000, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 32, (a.rows,), generator=g)]
    return asyncio.run(sample_rows(engine, prompts, max_new_tokens=a.new_tokens))


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if relaunched(__file__, argv):
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    import megatron_patches
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.models.tiny import make_tiny_hf_model
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.trainer.build import build_tokenizer
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, MoEConfig
    from mcore_agentic.workers.passes import log_prob_head

    megatron_patches.apply()
    par = ParallelConfig(expert_model_parallel_size=2)
    layout = initialize_parallel(par, seed=1)
    rank = dist.get_rank()
    box = [tempfile.mkdtemp(prefix="moe_routing_") if rank == 0 else None]
    dist.broadcast_object_list(box)
    path = str(Path(box[0]) / "qwen3_moe")
    if rank == 0:
        make_tiny_hf_model(path, "qwen3_moe", hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=4 * a.hidden, num_experts=a.experts,
                           num_experts_per_tok=a.topk, moe_intermediate_size=a.expert_ffn, seed=7)
    dist.barrier()
    cfg = ActorConfig(parallel=par, ppo_micro_batch_size_per_gpu=4, moe=MoEConfig(routing_replay="rollout"))
    vocab = len(build_tokenizer(path))  # the ids the engine samples from (the embedding table is padded past them)
    actor = Actor(cfg, ModelSpec(path, "float32", vocab_size=vocab, parallel=par), layout, mini_batch_sequences=a.rows)
    replayed = [0, 0]  # (fed pairs, pairs routed to the engine's experts) of the current pass

    def count(module, args, output):
        target = module.router_replay.target
        if target is None:
            return
        known = (target >= 0).all(-1)
        chosen = torch.zeros_like(output[1]).scatter_(1, target.clamp(min=0), True)
        replayed[0] += int(known.sum()) * target.shape[1]
        replayed[1] += int(((output[1] == chosen).all(-1) & known).sum()) * target.shape[1]

    for chunk in actor.model.chunks:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(count)
    head = log_prob_head(actor.model, 1.0, False)
    rows = []
    for engine_dtype in (torch.bfloat16, torch.float32):
        t = time.perf_counter()
        batch = _rollout(path, a, engine_dtype)
        rollout_s = time.perf_counter() - t
        half = a.rows // 2
        batch = batch.index(range(rank * half, (rank + 1) * half))
        mask = batch["response_mask"].bool()
        for replay in (False, True):
            replayed[:] = [0, 0]
            with actor.model.routing.use(replay=replay, measure=True):
                lp = actor.model.forward_only(batch, head, actor.batching)["log_probs"]
            agreement = actor.routing_metrics()["rollout/routing_agreement"]
            gap = (lp - batch["rollout_log_probs"])[mask].abs().double()
            stats = torch.tensor([float(gap.max()), float(gap.sum()), float(gap.numel()), *replayed],
                                 dtype=torch.float64)
            peak = stats[:1].clone()
            dist.all_reduce(stats)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            rows.append((str(engine_dtype).split(".")[-1], replay, agreement, float(stats[4] / stats[3]),
                         float(peak[0]), float(stats[1] / stats[2]), int(stats[2]), rollout_s))
    if rank == 0:
        print(f"Qwen3-MoE hidden {a.hidden}, {a.layers} layers x {a.experts} experts (top-{a.topk}), EP=2 fp32 trainer; "
              f"{a.rows} completions of {a.new_tokens} new tokens")
        print(f"{'engine':>8} {'replay':>6} {'routing agreement':>17} {'replayed':>8} {'gap max':>9} {'gap mean':>9} "
              f"{'tokens':>6}")
        for engine, replay, agreement, rep, gmax, gmean, n, _ in rows:
            print(f"{engine:>8} {'on' if replay else 'off':>6} {agreement:>17.4f} {rep:>8.4f} {gmax:>9.2e} "
                  f"{gmean:>9.2e} {n:>6}")
        off, on = rows[0], rows[1]
        print(f"bfloat16 engine, replay on / off: gap max {on[4] / off[4]:.2f}x, gap mean {on[5] / off[5]:.2f}x")
    destroy_parallel()


if __name__ == "__main__":
    main()
