"""Packed (THD) vs padded micro-batches: actor log-prob and update throughput on log-normal lengths.

Builds a small Qwen2-architecture model (``--hidden``/``--layers``) with the trainer's builders,
then on 2 gloo ranks (DP=2) runs the same batch of ``--batch`` synthetic trajectories whose
lengths are log-normal, clipped to 32..2,048 tokens, through ``Actor.compute_log_prob`` and
``Actor.update_policy`` in three modes, in this order: packed with a fixed micro-batch size,
packed with a token budget (``use_dynamic_bsz``), and padded with the same fixed micro-batch
size (today's layout before packing, ``model.use_remove_padding=false``). Each replica trains
its token-balanced share (``feed.distribute.deal_rows``). Prints real tokens/s, the largest
micro-batch the model ran (tokens, padding included: what bounds activation memory), the peak
resident memory of rank 0 during the mode (sampled every 5 ms; the allocator keeps freed pages,
so a later mode never reads lower than an earlier one: the padded mode runs last), and the
packed / padded ratios.

    python bench/packing.py                       # re-launches itself with torchrun, 2 ranks
    python bench/packing.py --batch 32 --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._ranks import init_cpu_ranks, relaunched  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="trajectories per step (global)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro", type=int, default=2, help="rows per micro-batch (fixed modes)")
    p.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (budget mode)")
    p.add_argument("--steps", type=int, default=1, help="timed repetitions per phase")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def lognormal_lengths(n: int, seed: int, low: int = 32, high: int = 2048) -> list[int]:
    """Trajectory lengths: log-normal (median ~270 tokens, a long tail), clipped to [low, high]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 1.1 + 5.6)
    return [int(x) for x in raw.clamp(low, high).round().tolist()]


def synthetic_batch(lengths: list[int], vocab: int, seed: int, prompt: int = 24):
    """Rollout-layout rows of the given total lengths (``prompt`` prompt tokens each), random ids and advantages."""
    from mcore_agentic.data.batch import Batch, build_rollout_layout

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (prompt,), generator=g) for _ in lengths]
    responses = [torch.randint(1, vocab, (n - prompt,), generator=g) for n in lengths]
    fields = {
        "response_mask": ([torch.ones(len(r), dtype=torch.long) for r in responses], torch.long),
        "advantages": ([torch.randn(len(r), generator=g) for r in responses], torch.float32),
    }
    return Batch(build_rollout_layout(prompts, responses, pad_token_id=0, response_fields=fields))


class PeakRSS:
    """Peak resident set size of this process while the context is open (sampled from /proc)."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run_mode(name: str, packed: bool, dynamic: bool, model_dir: str, full, a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from mcore_agentic.feed.distribute import deal_rows
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig

    par = ParallelConfig()
    layout = initialize_parallel(par, seed=1)
    cfg = ActorConfig(
        parallel=par, ppo_mini_batch_size=a.batch, ppo_micro_batch_size_per_gpu=a.micro, shuffle=False,
        use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=a.budget, optim=OptimConfig(lr=1e-6),
    )
    spec = ModelSpec(model_dir, "float32", use_remove_padding=packed, parallel=par)
    actor = Actor(cfg, spec, layout, mini_batch_sequences=a.batch)
    tokens = int(full["attention_mask"].sum())
    share = deal_rows(full["attention_mask"].sum(1).tolist(), chunk=len(full), dp=layout.data_parallel_size,
                      seed=None)[layout.dp_rank]
    batch = full.index(share)
    groups, mbs = actor.model.micro_batches(batch, actor.batching)
    largest = max(mb.packed.num_tokens for mb in mbs)
    with PeakRSS() as mem:
        batch = actor.compute_log_prob(batch)  # warm-up (and the old log-probs the update needs)

        def timed(fn) -> float:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(a.steps):
                fn()
            dist.barrier()
            return (time.perf_counter() - t) / a.steps

        fwd = timed(lambda: actor.compute_log_prob(batch))
        upd = timed(lambda: actor.update_policy(batch))
    actor = None
    destroy_parallel()
    return {"mode": name, "tokens": tokens, "micro": len(groups), "largest": largest, "fwd_s": fwd, "upd_s": upd,
            "fwd_tok_s": tokens / fwd, "upd_tok_s": tokens / upd, "peak_mib": mem.peak / 2**20}


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if relaunched(__file__, argv):
        return
    init_cpu_ranks()
    import torch.distributed as dist

    model_dir = os.path.join(tempfile.gettempdir(), f"mcore_agentic_bench_packing_h{a.hidden}_l{a.layers}")
    if dist.get_rank() == 0 and not (Path(model_dir) / "config.json").is_file():
        from mcore_agentic.models.tiny import make_tiny_hf_model

        make_tiny_hf_model(model_dir, vocab_size=4096, hidden_size=a.hidden, num_hidden_layers=a.layers,
                           num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
                           intermediate_size=a.hidden * 3, max_position_embeddings=2048)
    dist.barrier()
    lengths = lognormal_lengths(a.batch, a.seed)
    full = synthetic_batch(lengths, 4096, a.seed)
    rows = [
        _run_mode("packed", True, False, model_dir, full, a),
        _run_mode("packed+budget", True, True, model_dir, full, a),
        _run_mode("padded", False, False, model_dir, full, a),
    ]
    if dist.get_rank() == 0:
        print(f"\nactor on CPU, hidden {a.hidden} x {a.layers} layers, {a.batch} trajectories of {min(lengths)}-"
              f"{max(lengths)} tokens (log-normal, mean {sum(lengths) / len(lengths):.0f}), DP=2 on 2 gloo ranks, "
              f"fp32, micro {a.micro} rows or {a.budget} tokens, {a.steps} timed step(s)")
        print(f"{'mode':<14} {'micro-batches':>13} {'largest mb tok':>15} {'log-prob s':>11} {'log-prob tok/s':>15} "
              f"{'update s':>9} {'update tok/s':>13} {'peak RSS MiB':>13}")
        for r in rows:
            print(f"{r['mode']:<14} {r['micro']:>13} {r['largest']:>15,} {r['fwd_s']:>11.2f} {r['fwd_tok_s']:>15.1f} "
                  f"{r['upd_s']:>9.2f} {r['upd_tok_s']:>13.1f} {r['peak_mib']:>13.0f}")
        base = rows[-1]
        for r in rows[:-1]:
            print(f"{r['mode']} / padded: log-prob {r['fwd_tok_s'] / base['fwd_tok_s']:.2f}x, "
                  f"update {r['upd_tok_s'] / base['upd_tok_s']:.2f}x, largest micro-batch "
                  f"{r['largest'] / base['largest']:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
