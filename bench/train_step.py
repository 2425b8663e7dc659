"""Actor throughput: tokens/s of ``compute_log_prob`` and ``update_policy`` per TP layout, packed vs padded, and MFU.

Builds the ~100M-parameter ``100m`` tiny preset (Qwen2 architecture; ``--hidden`` etc. resize it) with the
same builders the trainer uses (``make_tiny_hf_model_from_preset`` -> ``Actor``), then runs each layout in
turn (on 2 ranks TP=1 is DP=2, TP=2 is DP=1): one warm-up, then ``--steps`` timed forward passes and PPO
updates over a random batch, packed (THD) and/or padded micro-batches. Prints a table and the throughput
ratios (measured in this run). MFU (model FLOPs of the real tokens: 2 x matmul params + causal attention
per forward, 3x for an update, over the GPU's dense bf16 peak) is reported on CUDA only.

    python bench/train_step.py                    # CPU: re-launches itself with torchrun, 2 gloo ranks
    torchrun --nproc_per_node 2 bench/train_step.py --steps 2
    python bench/train_step.py --device cuda --ranks 1 --layouts 1 --dtype bfloat16 --packing both \
        --min-response-frac 0.25 --batch 64 --prompt 128 --response 896 --micro 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._ranks import init_cpu_ranks, relaunched, require_device  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0}
"""Dense bf16 peak TFLOP/s by GPU name (substring of ``torch.cuda.get_device_name()``), for MFU."""


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="100m", help="tiny-model preset (mcore_agentic.models.tiny.TINY_PRESETS)")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--kv-heads", type=int, help="override the preset's KV heads")
    p.add_argument("--ffn", type=int, help="override the preset's MLP width")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--response", type=int, default=192, help="response tokens per sequence (the longest)")
    p.add_argument("--min-response-frac", type=float, default=1.0,
                   help="responses drawn uniformly from [frac x --response, --response] tokens (1.0: all full)")
    p.add_argument("--micro", type=int, default=2, help="micro-batch size per rank")
    p.add_argument("--steps", type=int, default=2, help="timed steps per phase")
    p.add_argument("--layouts", default="1,2", help="comma-separated TP sizes to compare (first is the baseline)")
    p.add_argument("--packing", choices=["packed", "padded", "both"], default="packed",
                   help="packed (THD) micro-batches, padded [rows, longest] ones, or both in turn")
    p.add_argument("--attention", choices=["fused", "eager", "both"], default="fused",
                   help="the local spec's core attention: fused kernels on CUDA (SDPA, varlen flash), the eager "
                        "einsum path, or both in turn (the eager rows are the baseline of the fused ones)")
    p.add_argument("--profile", action="store_true",
                   help="after each row's timing, print torch.profiler's top operators of one log-prob pass (rank 0): "
                        "where a packed forward spends its time (kernels, launches, host syncs)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ranks", type=int, default=2, help="ranks torchrun starts when this script relaunches itself")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model.dtype")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="dense peak TFLOP/s per GPU for MFU; 0: from the GPU's name on CUDA, none on CPU")
    p.add_argument("--json", default="", help="also write the rows (and the run's facts) to this JSON file")
    p.add_argument("--model-dir", default="", help="reuse/create the checkpoint here (default: a temp dir)")
    a = p.parse_args(argv)
    if not 0.0 < a.min_response_frac <= 1.0:
        p.error("--min-response-frac must be in (0, 1]")
    if any(int(tp) < 1 for tp in a.layouts.split(",")):
        p.error("--layouts: TP sizes must be positive integers")
    return a


def _overrides(a: argparse.Namespace) -> dict[str, int]:
    names = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "ffn": "intermediate_size"}
    return {hf: getattr(a, k) for k, hf in names.items() if getattr(a, k) is not None}


def _batch(n: int, prompt: int, response: int, vocab: int, seed: int = 0, min_frac: float = 1.0):
    from mcore_agentic.data.batch import Batch, build_rollout_layout

    g = torch.Generator().manual_seed(seed)
    lo = max(1, int(min_frac * response))
    lengths = torch.randint(lo, response + 1, (n,), generator=g).tolist() if lo < response else [response] * n
    prompts = torch.randint(1, vocab, (n, prompt), generator=g)
    responses = [torch.randint(1, vocab, (k,), generator=g) for k in lengths]
    fields = {"response_mask": ([torch.ones(k, dtype=torch.long) for k in lengths], torch.long),
              "advantages": ([torch.randn(k, generator=g) for k in lengths], torch.float32)}
    return Batch(build_rollout_layout(list(prompts), responses, pad_token_id=0, response_fields=fields,
                                      response_width=response))


def forward_flops(hf_config, row_lengths: list[int]) -> float:
    """Model FLOPs of one forward over rows of these real lengths (dense decoder: matmuls + causal attention)."""
    c = hf_config
    h, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * c.intermediate_size
    matmul_params = c.num_hidden_layers * per_layer + h * c.vocab_size  # + the output layer
    attention = c.num_hidden_layers * sum(2.0 * n * n * heads * hd for n in row_lengths)  # QK^T + AV, causal half
    return 2.0 * matmul_params * sum(row_lengths) + attention


def _peak_tflops(a: argparse.Namespace) -> float:
    if a.peak_tflops or a.device != "cuda":
        return a.peak_tflops
    name = torch.cuda.get_device_name()
    return next((v for k, v in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), 0.0)


def _run_layout(tp: int, model_dir: str, a: argparse.Namespace) -> list[dict[str, float]]:
    import torch.distributed as dist

    from mcore_agentic.models.spec import ModelSpec
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
    actor = Actor(cfg, ModelSpec(model_dir, a.dtype, parallel=par), layout, mini_batch_sequences=a.batch)
    full = _batch(a.batch, a.prompt, a.response, actor.model.vocab_size, min_frac=a.min_response_frac)
    lengths = full["attention_mask"].sum(1).tolist()
    tokens = int(sum(lengths))  # the step's, over every replica
    fwd_flops = forward_flops(actor.model.hf_config, lengths)
    cuda = a.device == "cuda"

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(a.steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - t) / a.steps

    from mcore_agentic.parallel.local_attention import LocalDotProductAttention

    rows = []
    params = sum(p.numel() for p in actor.model.chunks[0].parameters())
    fused_devices = LocalDotProductAttention.fused_devices
    attentions = ["eager", "fused"] if a.attention == "both" else [a.attention]
    for attention, packing in [(att, pk) for att in attentions
                               for pk in (["packed", "padded"] if a.packing == "both" else [a.packing])]:
        LocalDotProductAttention.fused_devices = fused_devices if attention == "fused" else ()
        actor.batching = dataclasses.replace(actor.batching, pack=packing == "packed")
        batch = full.chunk(layout.data_parallel_size)[layout.dp_rank]  # each replica trains its rows
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        batch = actor.compute_log_prob(batch)  # warm-up (and the old log-probs the update needs)
        actor.update_policy(batch)
        fwd = timed(lambda batch=batch: actor.compute_log_prob(batch))
        upd = timed(lambda batch=batch: actor.update_policy(batch))
        if a.profile:
            _profile(lambda batch=batch: actor.compute_log_prob(batch), f"{packing}, {attention} attention", cuda)
        row = {"tp": tp, "dp": layout.data_parallel_size, "packing": packing, "attention": attention,
               "params_per_rank": params,
               "tokens": tokens, "fwd_s": fwd, "upd_s": upd, "fwd_tok_s": tokens / fwd, "upd_tok_s": tokens / upd,
               "fwd_tflops": fwd_flops / fwd / 1e12, "upd_tflops": 3 * fwd_flops / upd / 1e12}
        if cuda:
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
    LocalDotProductAttention.fused_devices = fused_devices
    actor = None  # free this layout's model before the next one is built
    destroy_parallel()
    return rows


def _profile(fn, label: str, cuda: bool, rows: int = 25) -> None:
    """One call of ``fn`` under torch.profiler; rank 0 prints the top ``rows`` operators by self time and the
    device-to-host copies and synchronisations it counted."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if dist.get_rank() != 0:
        return
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    syncs = {e.key: e.count for e in events if any(k in e.key for k in ("Memcpy DtoH", "cudaStreamSynchronize",
                                                                       "cudaDeviceSynchronize", "aten::item",
                                                                       "aten::_local_scalar_dense"))}
    print(f"\nprofile of one log-prob pass ({label}): host syncs and device-to-host copies {syncs}")
    print(events.table(sort_by=sort, row_limit=rows))


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    require_device(a.device)
    if relaunched(__file__, argv, nproc=a.ranks):
        return
    init_cpu_ranks()  # on CUDA: nccl, this rank's GPU; the CPU patches are inert there
    import torch.distributed as dist

    world = dist.get_world_size()
    shape = "_".join(f"{k}{v}" for k, v in _overrides(a).items())
    model_dir = a.model_dir or os.path.join(tempfile.gettempdir(), f"mcore_agentic_bench_{a.preset}{shape}")
    if dist.get_rank() == 0 and not (Path(model_dir) / "config.json").is_file():
        from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset

        make_tiny_hf_model_from_preset(model_dir, a.preset, **_overrides(a))
    dist.barrier()
    rows = [row for tp in a.layouts.split(",") for row in _run_layout(int(tp), model_dir, a)]
    peak = _peak_tflops(a)
    for r in rows:
        if peak:
            r["fwd_mfu"] = r["fwd_tflops"] / world / peak
            r["upd_mfu"] = r["upd_tflops"] / world / peak
    if dist.get_rank() == 0:
        where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
        backend = dist.get_backend()
        shape = f"{a.preset} {_overrides(a)}" if _overrides(a) else a.preset
        print(f"\nactor on {where}, {shape} ({rows[0]['params_per_rank']:,} params on rank 0), "
              f"batch {a.batch} x {a.prompt}+{a.response} tokens (responses from {a.min_response_frac:.2f}x), "
              f"{rows[0]['tokens']:,} real tokens, micro {a.micro}/rank, {world} {backend} ranks, {a.dtype}, "
              f"{a.steps} timed steps" + (f", MFU over {peak:.0f} TFLOP/s per GPU" if peak else ""))
        print(f"{'TP':>3} {'DP':>3} {'packing':>7} {'attention':>9} {'log-prob s':>11} {'log-prob tok/s':>15} "
              f"{'update s':>9} {'update tok/s':>13}" + (f" {'fwd MFU':>8} {'upd MFU':>8}" if peak else ""))
        for r in rows:
            print(f"{r['tp']:>3} {r['dp']:>3} {r['packing']:>7} {r['attention']:>9} {r['fwd_s']:>11.3f} {r['fwd_tok_s']:>15.1f} "
                  f"{r['upd_s']:>9.3f} {r['upd_tok_s']:>13.1f}"
                  + (f" {r['fwd_mfu']:>8.3f} {r['upd_mfu']:>8.3f}" if peak else ""))
        base = rows[0]
        for r in rows[1:]:
            print(f"TP={r['tp']} {r['packing']} {r['attention']} / TP={base['tp']} {base['packing']} "
                  f"{base['attention']} throughput: "
                  f"log-prob {r['fwd_tok_s'] / base['fwd_tok_s']:.2f}x, update {r['upd_tok_s'] / base['upd_tok_s']:.2f}x")
        if a.json:
            facts = {"device": where, "world_size": world, "backend": backend, "dtype": a.dtype, "preset": a.preset,
                     "overrides": _overrides(a), "peak_tflops": peak, "rows": rows}
            Path(a.json).write_text(json.dumps(facts, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
