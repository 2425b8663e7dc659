"""The default job's rollout on each CPU engine: transformers (the reference) vs vLLM in-process, same run.

Same prompts (the default job's first ``--prompts`` training rows), same tiny checkpoint, same
sampling (``rollout.*`` of ``configs/default_tiny.yaml``, ``rollout.seed`` set so every request is
seeded), same tools, the real driver and agent loop. Per engine:

* start-up seconds (checkpoint load; vLLM also builds its scheduler and KV cache);
* one weight sync: the checkpoint's tensors in ``sharding.bucket_size_mb`` buckets, ``update_weights``
  per bucket then ``finish_weight_update`` (the engine side of the sharding manager's sync);
* the rollout ``--repeats`` times: trajectories/s, sampled tokens/s (loss-mask tokens);
* the prefix-cache hit rate (prompt tokens served from cache / prompt tokens; ``prefix_cache_stats()``);
* what ``release_memory`` frees: the process's resident memory before and after it (MiB).

Usage: ``python bench/rollout_engines.py [--prompts 32] [--repeats 2] [overrides ...]`` (overrides as for
``launch/pretrain_rl.py``, e.g. ``rollout.n=8``).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import psutil
import torch

from mcore_agentic.config.load import compose, load_config
from mcore_agentic.feed.build import build_datasets, build_tools
from mcore_agentic.rollout.driver import generate_sequences_sync
from mcore_agentic.rollout.engines import build_engine
from mcore_agentic.rollout.engines.base import prefix_cache_stats
from mcore_agentic.trainer.build import build_tokenizer, ensure_model, model_spec


def checkpoint_buckets(model_path: Any, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(model_path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    buckets, current, size = [], [], 0
    for name, tensor in state.items():
        current.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def run_engine(name: str, cfg: Any, rows: list[dict], tools: dict, interactions: dict, executor: Any,
               tokenizer: Any, model_path: Any, repeats: int) -> dict[str, float]:
    rollout = cfg.rollout.__class__(**{**vars(cfg.rollout), "name": name})
    start = time.perf_counter()
    engine = build_engine(rollout, model_spec(cfg, vocab_size=len(tokenizer)), device="cpu", seed=cfg.seed)
    startup = time.perf_counter() - start

    buckets = checkpoint_buckets(model_path, cfg.sharding.bucket_bytes)
    start = time.perf_counter()
    engine.resume_memory()
    for bucket in buckets:
        engine.update_weights(bucket, version=1)
    engine.finish_weight_update(1)
    sync = time.perf_counter() - start

    walls, tokens, trajectories = [], 0, 0
    for _ in range(repeats):
        start = time.perf_counter()
        batch = generate_sequences_sync(rows, engine, tools, interactions, rollout, tokenizer, executor)
        walls.append(time.perf_counter() - start)
        tokens += int(batch["response_mask"].sum())
        trajectories += len(batch)
    wall = sum(walls)
    out = {"startup_s": startup, "sync_s": sync, "traj_per_s": trajectories / wall, "tok_per_s": tokens / wall,
           "first_s": walls[0], "hit_rate": float("nan")}
    cache = prefix_cache_stats(engine)
    if cache is not None:
        out["hit_rate"] = cache.hit_rate
    process = psutil.Process()
    gc.collect()
    before = process.memory_info().rss
    engine.release_memory()
    gc.collect()
    out["released_mb"] = (before - process.memory_info().rss) / 2**20
    engine.resume_memory()
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    del engine
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(compose("default_tiny", overrides=["rollout.seed=0", *args.overrides]))
    model_path = ensure_model(cfg)
    tokenizer = build_tokenizer(model_path)
    tools, interactions, executor = build_tools(cfg.rollout)
    train, _ = build_datasets(cfg.data, cfg.rollout, tokenizer, tools)
    rows = [train[i] for i in range(min(args.prompts, len(train)))]
    torch.set_num_threads(1)
    results = {}
    try:
        for name in ("hf", "vllm"):
            results[name] = run_engine(name, cfg, rows, tools, interactions, executor, tokenizer, model_path,
                                       args.repeats)
    finally:
        if executor is not None:
            executor.shutdown()
    hf, vl = results["hf"], results["vllm"]
    print(f"default job rollout: {len(rows)} prompts x n={cfg.rollout.n}, {args.repeats} repeats, "
          f"response_length={cfg.rollout.response_length}, model {model_path.name}, 1 thread")
    print(f"{'engine':>14} {'start s':>8} {'sync s':>8} {'traj/s':>8} {'tok/s':>8} {'1st roll s':>10} {'cache hit':>9} "
          f"{'freed MiB':>9}")
    for name, r in (("transformers", hf), ("vLLM", vl)):
        print(f"{name:>14} {r['startup_s']:>8.2f} {r['sync_s']:>8.3f} {r['traj_per_s']:>8.2f} {r['tok_per_s']:>8.0f} "
              f"{r['first_s']:>10.2f} {r['hit_rate']:>9.2f} {r['released_mb']:>9.1f}")
    print(f"vLLM / transformers: trajectories/s {vl['traj_per_s'] / hf['traj_per_s']:.2f}x, "
          f"tokens/s {vl['tok_per_s'] / hf['tok_per_s']:.2f}x, weight sync {vl['sync_s'] / hf['sync_s']:.2f}x the time")


if __name__ == "__main__":
    main()
