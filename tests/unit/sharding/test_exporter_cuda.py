"""On a GPU: the export's peak extra CUDA memory stays within ``max(bucket, largest) + largest``.

Measured with ``torch.cuda.max_memory_allocated`` around a full streaming export of a TP=1
Megatron model on one rank (the CPU tests measure the same bound with ``LiveBytes``).
Skipped cleanly without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SLACK = 2 * 1024 * 1024  # caching-allocator rounding of the few dozen blocks alive at once


def _body(rank: int, world_size: int) -> list[dict]:
    import transformers

    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.sharding.exporter import StreamingExporter

    torch.cuda.set_device(0)
    par = ParallelConfig()
    initialize_parallel(par, seed=1)
    config = transformers.Qwen2Config(
        vocab_size=8000, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, use_sliding_window=False,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    bridge = get_bridge(config)
    chunks = bridge.build_model(config, bridge.transformer_config(config, par))
    out = []
    for bucket_bytes in (2 * 1024 * 1024, 12 * 1024 * 1024):
        exporter = StreamingExporter(bridge, chunks, bucket_bytes=bucket_bytes)
        largest = exporter.plan.largest_nbytes
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        n = 0
        for bucket in exporter.buckets():
            n += len(bucket)
        torch.cuda.synchronize()
        out.append(dict(bucket=bucket_bytes, tensors=n, extra=torch.cuda.max_memory_allocated() - base,
                        bound=max(bucket_bytes, largest) + largest, largest=largest))
    return out


def test_peak_cuda_memory_of_export_is_bounded():
    for row in run_distributed(_body, world_size=1)[0]:
        assert row["tensors"] > 0
        assert row["largest"] <= row["extra"] <= row["bound"] + SLACK, row
