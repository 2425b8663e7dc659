"""Peak host memory and time of one actor update on a 32k-token row: whole vs chunked logits, with and without
activation recomputation.

Each variant runs in a fresh process (its peak RSS is ``ru_maxrss``) on one gloo rank: a tiny Qwen2 of long context
(hidden 64, 2 layers, ``--vocab`` ids, fp32) builds an actor, scores one row of ``--tokens`` tokens (the old-log-prob
pass, with entropy) and takes one PPO update on it (one micro-batch), attention fused (SDPA on CPU, as on a GPU).
The variants:

* ``whole``: ``model.logits_chunk_mb=0`` (megatron-core's output layer: the whole fp32 logits, kept for backward);
* ``chunked``: the default 256 MiB chunks;
* ``chunked+recompute``: and ``actor.recompute_granularity=full``;
* ``chunked+recompute+host-adam`` (bf16/fp16 only, so the GPU check's): and ``actor.optim.optimizer_cpu_offload``
  (the fp32 masters and Adam moments on the host: *before* drops by 12 bytes per parameter, the update pays a host
  step).

Usage: ``python bench/long_row_memory.py [--tokens 32768] [--vocab 32768] [--chunk-mb 256]``. The planner's figures
for the same micro-batch are printed beside (its logits and activation terms, :mod:`mcore_agentic.plan.activations`).

On a GPU (the GPU check's memory step): ``--device cuda --dtype bfloat16 --hidden 1536 --layers 28 --heads 12
--kv-heads 2 --ffn 8960 --vocab 151936 --tokens 8192`` (a Qwen2.5-1.5B-shaped body), where *peak* is
``torch.cuda.max_memory_allocated`` over the two passes (weights, gradients and optimizer state included), and
``--variants`` adds ``chunked+selective`` (core_attn, layernorm, mlp); ``--json PATH`` writes the rows. There each pass's
own peak above what was resident before it (``log_prob_gb``, ``update_gb``) is printed beside the planner's figure
for that phase (``plan_log_prob_gb``: :func:`~mcore_agentic.plan.activations.forward_peak_bytes`;
``plan_update_peak_gb``: :func:`~mcore_agentic.plan.activations.update_peak_bytes`), the planner-vs-measured table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = {
    "whole": {"logits_chunk_mb": 0, "recompute": {}},
    "chunked": {"logits_chunk_mb": None, "recompute": {}},
    "chunked+recompute": {"logits_chunk_mb": None, "recompute": {"recompute_granularity": "full"}},
    "chunked+selective": {"logits_chunk_mb": None, "recompute": {
        "recompute_granularity": "selective", "recompute_modules": ("core_attn", "layernorm", "mlp")}},
    "chunked+recompute+host-adam": {"logits_chunk_mb": None, "recompute": {"recompute_granularity": "full"},
                                    "optim": {"optimizer_cpu_offload": True}},
}
SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)


def make_model(path: Path, vocab: int, tokens: int, shape: dict) -> None:
    import torch
    import transformers

    from tests.helpers.hf import redraw_weights, tiny_qwen2_config

    config = tiny_qwen2_config(vocab=vocab, layers=shape["layers"], max_positions=tokens + 64)
    config.hidden_size, config.intermediate_size = shape["hidden"], shape["ffn"]
    config.num_attention_heads, config.num_key_value_heads = shape["heads"], shape["kv_heads"]
    torch.manual_seed(0)
    redraw_weights(transformers.Qwen2ForCausalLM(config).eval(), 0.1).save_pretrained(str(path))


def one_variant(path: str, name: str, tokens: int, chunk_mb: int, device: str, dtype: str) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import torch

    import megatron_patches
    from mcore_agentic.data.batch import Batch
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.parallel.local_attention import LocalDotProductAttention
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig, RecomputeConfig

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    megatron_patches.apply()
    LocalDotProductAttention.fused_devices = ("cuda", "cpu")
    variant = VARIANTS[name]
    par = ParallelConfig()
    layout = initialize_parallel(par, 1)
    mb = chunk_mb if variant["logits_chunk_mb"] is None else variant["logits_chunk_mb"]
    actor = Actor(ActorConfig(parallel=par, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                              optim=OptimConfig(lr=1e-5, **variant.get("optim", {})),
                              recompute=RecomputeConfig(**variant["recompute"])),
                  ModelSpec(path, dtype, parallel=par, logits_chunk_mb=mb), layout, mini_batch_sequences=1)
    vocab = actor.model.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt, response = 512, tokens - 512
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    mask = torch.ones(1, tokens, dtype=torch.long)
    batch = Batch(tensors={
        "prompts": ids[:, :prompt], "responses": ids[:, prompt:], "input_ids": ids, "attention_mask": mask,
        "position_ids": torch.arange(tokens).unsqueeze(0), "response_mask": torch.ones(1, response, dtype=torch.long),
        "advantages": torch.randn(1, response, generator=g),
    })
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    start = time.perf_counter()
    scored = actor.compute_log_prob(batch, calculate_entropy=True)
    scored_s = time.perf_counter() - start
    if cuda:  # each pass's own peak above what was resident before it
        torch.cuda.synchronize()
        log_prob_gb = torch.cuda.max_memory_allocated() / 2**30 - resident
        before_update = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    metrics = actor.update_policy(scored)
    total_s = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        update_gb = torch.cuda.max_memory_allocated() / 2**30 - before_update
        return {"variant": name, "peak_gb": resident + max(log_prob_gb, before_update - resident + update_gb),
                "before_gb": resident, "log_prob_gb": log_prob_gb, "update_gb": update_gb,
                "log_prob_s": scored_s, "update_s": total_s - scored_s, "grad_norm": metrics["grad_norm"],
                "log_prob_sum": float(scored["old_log_probs"].float().sum()),
                "tokens_per_s": tokens / total_s, "chunk_tokens": actor.model.logits_chunk_tokens}
    return {"variant": name, "peak_gb": peak / 2**20, "before_gb": before / 2**20, "log_prob_s": scored_s,
            "update_s": total_s - scored_s, "grad_norm": metrics["grad_norm"],
            "log_prob_sum": float(scored["old_log_probs"].sum()), "chunk_tokens": actor.model.logits_chunk_tokens}


def planner_bytes(vocab: int, tokens: int, chunk_mb: int, recompute: dict, shape: dict, dtype: str,
                  fused: bool) -> tuple[float, float, float]:
    """The planner's saved bytes, update peak and log-prob-pass peak for this micro-batch, GiB."""
    from mcore_agentic.models.spec import logits_chunk_tokens
    from mcore_agentic.plan.activations import (
        Dims,
        Recompute,
        Split,
        forward_peak_bytes,
        saved_bytes,
        update_peak_bytes,
    )
    from mcore_agentic.workers.config import RecomputeConfig

    padded = -(-vocab // 128) * 128
    dims = Dims(hidden=shape["hidden"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                head_dim=shape["hidden"] // shape["heads"], ffn=shape["ffn"], layers=shape["layers"], vocab=padded)
    split = Split(dtype_bytes=4 if dtype == "float32" else 2, fused_attention=fused,
                  logits_chunk_tokens=logits_chunk_tokens(chunk_mb, padded))
    rc = Recompute.of(RecomputeConfig(**recompute))
    rows, layers = [tokens], shape["layers"]
    return (saved_bytes(dims, split, rows, layers=layers, last_stage=True, recompute=rc) / 2**30,
            update_peak_bytes(dims, split, rows, layers=layers, last_stage=True, recompute=rc) / 2**30,
            forward_peak_bytes(dims, split, rows, last_stage=True) / 2**30)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk-mb", type=int, default=256)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="float32")
    for key, value in SHAPE.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    ap.add_argument("--variants", default="whole,chunked,chunked+recompute", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    args = _args()
    if args.one:
        print(json.dumps(one_variant(args.model, args.one, args.tokens, args.chunk_mb, args.device, args.dtype)))
        return
    shape = {key: getattr(args, key) for key in SHAPE}
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long"
        make_model(path, args.vocab, args.tokens, shape)
        print(f"one {args.tokens}-token row, vocabulary {args.vocab}, Qwen2 {shape}, {args.dtype}, 1 rank on "
              f"{args.device} ({'device peak' if args.device == 'cuda' else 'peak RSS'})")
        print(f"{'variant':<20} {'peak RSS GB':>11} {'of it, passes':>13} {'log-prob s':>10} {'update s':>8} {'chunk':>6} "
              f"{'plan saved GB':>13} {'plan update GB':>14} {'grad norm':>10}")
        rows = []
        for name in names:
            variant = VARIANTS[name]
            out = subprocess.run([sys.executable, __file__, "--one", name, "--model", str(path), "--tokens",
                                  str(args.tokens), "--chunk-mb", str(args.chunk_mb), "--device", args.device,
                                  "--dtype", args.dtype], capture_output=True, text=True, check=True, cwd=REPO)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            mb = args.chunk_mb if variant["logits_chunk_mb"] is None else variant["logits_chunk_mb"]
            saved, peak, forward = planner_bytes(args.vocab, args.tokens, mb, variant["recompute"], shape, args.dtype,
                                                 fused=True)
            r.update(plan_saved_gb=saved, plan_update_peak_gb=peak, plan_log_prob_gb=forward)
            rows.append(r)
            print(f"{name:<20} {r['peak_gb']:>11.2f} {r['peak_gb'] - r['before_gb']:>13.2f} {r['log_prob_s']:>10.1f} "
                  f"{r['update_s']:>8.1f} "
                  f"{r['chunk_tokens']:>6} {saved:>13.2f} {peak:>14.2f} {r['grad_norm']:>10.4g}")
        if args.device == "cuda":  # the planner-vs-measured table: each pass's peak above what it found resident
            print(f"{'variant':<28} {'log-prob GB':>11} {'plan':>6} {'update GB':>9} {'plan':>6} {'tokens/s':>9}")
            for r in rows:
                print(f"{r['variant']:<28} {r['log_prob_gb']:>11.2f} {r['plan_log_prob_gb']:>6.2f} "
                      f"{r['update_gb']:>9.2f} {r['plan_update_peak_gb']:>6.2f} {r['tokens_per_s']:>9.0f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"tokens": args.tokens, "vocab": args.vocab, "shape": shape,
                                                   "dtype": args.dtype, "device": args.device, "rows": rows}))
        base = rows[0]
        for r in rows[1:]:
            passes = (base["peak_gb"] - base["before_gb"]) / max(r["peak_gb"] - r["before_gb"], 1e-9)
            print(f"{r['variant']}: the passes' peak {passes:.2f}x lower than whole's; same log-probs: "
                  f"{abs(r['log_prob_sum'] - base['log_prob_sum']) <= 1e-3 * abs(base['log_prob_sum'])}; "
                  f"grad norm {r['grad_norm'] / base['grad_norm']:.6f} of whole's")


if __name__ == "__main__":
    main()
