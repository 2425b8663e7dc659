"""Packed (THD) rows without per-layer host syncs: which spec reads ``cu_seqlens`` where, checked on CPU.

The ``meta`` device stands in for a GPU: a tensor there has no data, so any host read of one (``.tolist()``,
``.item()``, a Python ``bool``) raises. A local-spec GPTModel moved to ``meta`` runs a packed forward only when
the offsets are host tensors; given device offsets it stops at megatron-core's THD RoPE, which reads them in every
attention layer (the host sync the TE spec avoids with its fused THD kernel, ``apply_rope_fusion``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import make_tiny_hf, setup_rank


def test_offsets_live_on_the_host_for_the_local_spec_only():
    from mcore_agentic.models.transformer_impl import fusion_settings, thd_offsets_on_host

    assert thd_offsets_on_host(False) is True and thd_offsets_on_host(True) is False
    assert fusion_settings(True, "cuda")["apply_rope_fusion"]  # TE's THD kernel reads them on the GPU


def _forward_on_meta(rank: int, world_size: int, path: str) -> dict[str, str]:
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.models.transformer_impl import thd_offsets_on_host

    par, _ = setup_rank(1)
    hf = load_hf_config(path)
    bridge = get_bridge(hf)
    model = bridge.build_model(hf, bridge.transformer_config(hf, par), use_te=False)[0].eval().to("meta")
    rope = model.rotary_pos_emb
    rope.inv_freq = rope.inv_freq.to("meta")  # a plain attribute megatron makes on the compute device, not a buffer
    lengths = [6, 10, 4]
    total = sum(lengths)
    out = {}
    for name, device in (("host", "cpu" if thd_offsets_on_host(False) else "meta"), ("device", "meta")):
        cu = torch.tensor([0, 6, 16, 20], dtype=torch.int32, device=device)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
            max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
        )
        ids = torch.zeros(1, total, dtype=torch.long, device="meta")
        try:
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=ids, attention_mask=None, packed_seq_params=params)
            out[name] = f"ok {tuple(logits.shape)} {logits.device}"
        except NotImplementedError as exc:  # "Cannot copy out of meta tensor": a host read of device memory
            import traceback

            frame = traceback.extract_tb(exc.__traceback__)[-1]
            out[name] = f"host read in {frame.name}: {frame.line}"
    return out


@pytest.fixture(scope="module")
def meta_runs(tmp_path_factory) -> dict[str, str]:
    path = str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen2", layers=2))
    return run_distributed(_forward_on_meta, 1, args=(path,))[0]


def test_local_spec_packed_forward_reads_no_device_memory_with_host_offsets(meta_runs):
    assert meta_runs["host"].startswith("ok (1, 20, "), meta_runs["host"]
    assert meta_runs["host"].endswith(" meta")


def test_device_offsets_are_read_on_the_host_by_megatrons_thd_rope(meta_runs):
    assert meta_runs["device"] == (
        "host read in _apply_rotary_pos_emb_thd: seqlens = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()"
    ), meta_runs["device"]
