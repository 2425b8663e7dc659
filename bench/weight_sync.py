"""Weight-sync export: bucketed Megatron -> HF export at TP=2 (or TP=1 on one GPU) vs a raw all-gather of the same bytes.

Builds a Qwen2-architecture Megatron model (~245M parameters by default; random init, no
checkpoint) with the trainer's builders (``get_bridge`` -> ``transformer_config`` ->
``build_model``) on 2 gloo ranks at TP=2 (``--device cuda --ranks 1``: one GPU at TP=1, where the raw
all-gather is a device copy), then for each bucket size times a full
:class:`~mcore_agentic.sharding.exporter.StreamingExporter` pass, and in the same run a raw
``all_gather`` of the same bytes in chunks of the same size (the floor: pure communication,
no merge or HF conversion). Prints a table with the export / raw ratio and the exporter's peak
live bytes against its bound ``max(bucket, largest) + largest``.

With ``--moe`` the model is a Qwen3-MoE (16 experts of 512, top-4, in each of 8 layers by default) at
EP=2: each rank holds half of every layer's experts, the export broadcasts each expert over the EP group,
and the raw baseline all-gathers the expert bytes over the EP group in chunks of the bucket size.

    python bench/weight_sync.py                        # re-launches itself with torchrun, 2 ranks
    python bench/weight_sync.py --moe --hidden 512 --layers 8 --heads 8 --kv-heads 4
    torchrun --nproc_per_node 2 bench/weight_sync.py --buckets 16,64 --repeats 1
    python bench/weight_sync.py --device cuda --ranks 1 --dtype bfloat16 --hidden 2048 --layers 24 --ffn 5632
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._ranks import relaunched, require_device  # noqa: E402

MB = 1024 * 1024


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--buckets", default="16,64,256", help="comma-separated bucket sizes in MiB")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per row (the fastest is reported)")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE at EP=2 instead of a dense Qwen2 at TP=2")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ranks", type=int, default=2, help="ranks torchrun starts (TP, or EP with --moe, is this many)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's params_dtype")
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    if a.moe and a.ranks < 2:
        p.error("--moe needs --ranks >= 2 (the export moves experts over the EP group)")
    return a


def _hf_config(a: argparse.Namespace):
    import transformers

    if a.moe:
        config = transformers.Qwen3MoeConfig(
            vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
            num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
            max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32",
            num_experts=a.experts, num_experts_per_tok=a.topk, moe_intermediate_size=a.expert_ffn,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
        return config
    config = transformers.Qwen2Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=False, use_sliding_window=False, torch_dtype="float32",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def _timed(fn, repeats: int) -> float:
    import torch.distributed as dist

    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        best = min(best, time.perf_counter() - t)
    return best


def _raw_all_gather(local_bytes: int, chunk_bytes: int, group, device: str = "cpu") -> None:
    """All-gather ``local_bytes`` per rank in pieces whose gathered output is ``chunk_bytes`` (a copy on one rank)."""
    import torch.distributed as dist

    tp = dist.get_world_size(group)
    per_piece = max(chunk_bytes // tp // 4, 1)
    remaining = local_bytes // 4
    while remaining > 0:
        n = min(per_piece, remaining)
        src = torch.ones(n, dtype=torch.float32, device=device)
        out = torch.empty(tp * n, dtype=torch.float32, device=device)
        dist.all_gather(list(out.chunk(tp)), src, group=group)
        remaining -= n
        del src, out


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    require_device(a.device)
    if relaunched(__file__, argv, nproc=a.ranks):
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import megatron_patches
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, init_distributed, initialize_parallel
    from mcore_agentic.sharding.exporter import LiveBytes, StreamingExporter

    megatron_patches.apply()
    init_distributed()  # on CUDA: nccl and this rank's GPU (torchrun's env); gloo on CPU
    world = dist.get_world_size()
    par = ParallelConfig(expert_model_parallel_size=world) if a.moe else ParallelConfig(tensor_model_parallel_size=world)
    layout = initialize_parallel(par, seed=1)
    hf_config = _hf_config(a)
    bridge = get_bridge(hf_config)
    t = time.perf_counter()
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    chunks = bridge.build_model(hf_config, bridge.transformer_config(hf_config, par, params_dtype=dtype))
    build_s = time.perf_counter() - t
    local = bridge.local_params(chunks)
    if a.moe:  # what must move: each rank's experts, to the other EP rank
        local_bytes = sum(p.numel() * p.element_size() for n, p in local.items() if bridge.is_expert(n))
        tp_group = bridge.expert_group(chunks)
    else:
        local_bytes = sum(p.numel() * p.element_size() for p in local.values())
        tp_group = layout.tp_group()
    rows = []
    for bucket_mb in (float(b) for b in a.buckets.split(",")):
        chunk = int(bucket_mb * MB)
        raw = _timed(lambda chunk=chunk: _raw_all_gather(local_bytes, chunk, tp_group, a.device), a.repeats)
        exporter = StreamingExporter(bridge, chunks, bucket_bytes=int(bucket_mb * MB))
        exporter.plan  # noqa: B018 -- the cached PP metadata exchange is not part of a sync
        counts = {"buckets": 0, "bytes": 0}

        def run(exporter=exporter, counts=counts) -> None:
            counts["buckets"] = counts["bytes"] = 0
            for bucket in exporter.buckets():
                counts["buckets"] += 1
                counts["bytes"] += sum(x.numel() * x.element_size() for _, x in bucket)

        seconds = _timed(run, a.repeats)
        tracker = LiveBytes()  # one more pass, tracked, for the memory column
        exporter.tracker = tracker
        run()
        bound = max(exporter.bucket_bytes, exporter.plan.largest_nbytes) + exporter.plan.largest_nbytes
        rows.append(dict(bucket_mb=bucket_mb, seconds=seconds, raw=raw, buckets=counts["buckets"],
                         hf_bytes=counts["bytes"], peak=tracker.peak, bound=bound))
    if dist.get_rank() == 0:
        params = sum(e.numel for e in exporter.plan.entries)
        what = (f"Qwen3-MoE {params / 1e6:.0f}M params ({a.experts} experts of {a.expert_ffn}, top-{a.topk}, hidden "
                f"{a.hidden}, {a.layers} layers, vocab {a.vocab}), {a.dtype}, EP={world}" if a.moe else
                f"Qwen2 {params / 1e6:.0f}M params (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}), {a.dtype}, "
                f"TP={world}")
        where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
        print(f"\nweight-sync export on {where}: {what} on {world} {dist.get_backend()} ranks; model build "
              f"{build_s:.1f}s; best of {a.repeats}")
        print(f"{'bucket MiB':>10} {'buckets':>7} {'export s':>9} {'GB/s':>6} {'raw a-g s':>9} "
              f"{'export/raw':>10} {'peak MiB':>9} {'bound MiB':>9}")
        for r in rows:
            print(f"{r['bucket_mb']:>10.0f} {r['buckets']:>7} {r['seconds']:>9.2f} "
                  f"{r['hf_bytes'] / r['seconds'] / 1e9:>6.2f} {r['raw']:>9.2f} {r['seconds'] / r['raw']:>10.2f} "
                  f"{r['peak'] / MB:>9.1f} {r['bound'] / MB:>9.1f}")
        if a.json:
            for r in rows:
                r.update(export_gb_s=r["hf_bytes"] / r["seconds"] / 1e9, raw_gb_s=local_bytes * world / r["raw"] / 1e9,
                         export_over_raw=r["seconds"] / r["raw"])
            facts = {"device": where, "world_size": world, "dtype": a.dtype, "params": params, "moe": a.moe,
                     "build_s": build_s, "rows": rows}
            Path(a.json).write_text(json.dumps(facts, indent=1))
    chunks = None
    destroy_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
