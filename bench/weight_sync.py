"""Weight-sync export on CPU: bucketed Megatron -> HF export at TP=2 vs a raw all-gather of the same bytes.

Builds a Qwen2-architecture Megatron model (~245M parameters by default; random init, no
checkpoint) with the trainer's builders (``get_bridge`` -> ``transformer_config`` ->
``build_model``) on 2 gloo ranks at TP=2, then for each bucket size times a full
:class:`~mcore_agentic.sharding.exporter.StreamingExporter` pass, and in the same run a raw
``all_gather`` of the same bytes in chunks of the same size (the floor: pure communication,
no merge or HF conversion). Prints a table with the export / raw ratio and the exporter's peak
live bytes against its bound ``max(bucket, largest) + largest``.

    python bench/weight_sync.py                        # re-launches itself with torchrun, 2 ranks
    torchrun --nproc_per_node 2 bench/weight_sync.py --buckets 16,64 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._ranks import relaunched  # noqa: E402

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
    return p.parse_args(argv)


def _hf_config(a: argparse.Namespace):
    import transformers

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
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - t)
    return best


def _raw_all_gather(local_bytes: int, chunk_bytes: int, tp: int, group) -> None:
    """All-gather ``local_bytes`` per rank in pieces whose gathered output is ``chunk_bytes``."""
    import torch.distributed as dist

    per_piece = max(chunk_bytes // tp // 4, 1)
    remaining = local_bytes // 4
    while remaining > 0:
        n = min(per_piece, remaining)
        src = torch.ones(n, dtype=torch.float32)
        out = torch.empty(tp * n, dtype=torch.float32)
        dist.all_gather(list(out.chunk(tp)), src, group=group)
        remaining -= n
        del src, out


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if relaunched(__file__, argv):
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import megatron_patches
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.sharding.exporter import LiveBytes, StreamingExporter

    megatron_patches.apply()
    par = ParallelConfig(tensor_model_parallel_size=2)
    layout = initialize_parallel(par, seed=1)
    hf_config = _hf_config(a)
    bridge = get_bridge(hf_config)
    t = time.perf_counter()
    chunks = bridge.build_model(hf_config, bridge.transformer_config(hf_config, par))
    build_s = time.perf_counter() - t
    local = bridge.local_params(chunks)
    local_bytes = sum(p.numel() * p.element_size() for p in local.values())
    tp_group = layout.tp_group()
    rows = []
    for bucket_mb in (float(b) for b in a.buckets.split(",")):
        chunk = int(bucket_mb * MB)
        raw = _timed(lambda chunk=chunk: _raw_all_gather(local_bytes, chunk, 2, tp_group), a.repeats)
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
        print(f"\nweight-sync export on CPU: Qwen2 {params / 1e6:.0f}M params (hidden {a.hidden}, {a.layers} layers, "
              f"vocab {a.vocab}), fp32, TP=2 on {dist.get_world_size()} gloo ranks; model build {build_s:.1f}s; "
              f"best of {a.repeats}")
        print(f"{'bucket MiB':>10} {'buckets':>7} {'export s':>9} {'GB/s':>6} {'raw a-g s':>9} "
              f"{'export/raw':>10} {'peak MiB':>9} {'bound MiB':>9}")
        for r in rows:
            print(f"{r['bucket_mb']:>10.0f} {r['buckets']:>7} {r['seconds']:>9.2f} "
                  f"{r['hf_bytes'] / r['seconds'] / 1e9:>6.2f} {r['raw']:>9.2f} {r['seconds'] / r['raw']:>10.2f} "
                  f"{r['peak'] / MB:>9.1f} {r['bound'] / MB:>9.1f}")
    chunks = None
    destroy_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
