"""On a GPU: the local spec's fused attention (SDPA; packed rows through torch's varlen flash kernel where this
torch has it) equals its eager path in bf16, values and gradients, padded and packed, GQA included. Skipped
cleanly without CUDA; the GPU check (``bench/gpu/check.sh``) runs ``pytest -m gpu``. On CPU the same paths are
checked against the eager one by ``test_local_attention.py`` (SDPA for real, the varlen call through stand-ins
with each torch release's signature)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _fused_vs_eager(rank: int, world_size: int) -> bytes:
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_patches
    from mcore_agentic.parallel import local_attention as LA
    from tests.unit.megatron_patches import _tiny_gpt as T
    from tests.unit.parallel.test_local_attention import LENS, _packed_params

    megatron_patches.apply()
    T.init_parallel()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = T.transformer_config(num_attention_heads=16, num_query_groups=4, kv_channels=64, hidden_size=1024)
    calls = {"varlen": 0}
    kernel = LA.VARLEN_ATTN
    if kernel is not None:
        @functools.wraps(kernel)  # the call is built from the kernel's signature, which wraps keeps
        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls["varlen"] += 1
            return kernel(*args, **kwargs)

        LA.VARLEN_ATTN = counted
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, torch.bfloat16).requires_grad_(True)

    def run(fused: bool, q, k, v, w, **kw) -> list[torch.Tensor]:
        attn = LA.LocalDotProductAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                           attention_type="self")
        attn.fused_devices = ("cuda",) if fused else ()
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = attn(q, k, v, None, **kw)
        (out.float() * w).sum().backward()
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    out: dict[str, Any] = {"varlen_available": kernel is not None, "torch": torch.__version__}
    s, b = 512, 2
    q, k, v = leaf(s, b, 16, 64), leaf(s, b, 4, 64), leaf(s, b, 4, 64)
    w = torch.randn(s, b, 1024, generator=g).to(dev)
    out["padded"] = [(f.cpu(), e.cpu()) for f, e in zip(run(True, q, k, v, w), run(False, q, k, v, w))]

    lens = [n * 32 for n in LENS]  # 128, 384, 256 tokens
    t = sum(lens)
    params = _packed_params(LA.LocalPackedSeqParams)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        setattr(params, name, cu)
    params.max_seqlen_q = params.max_seqlen_kv = max(lens)
    params.cu_seqlens_device = cu.to(dev)
    qp, kp, vp = leaf(t, 16, 64), leaf(t, 4, 64), leaf(t, 4, 64)
    wp = torch.randn(t, 1024, generator=g).to(dev)
    fused = run(True, qp, kp, vp, wp, packed_seq_params=params)
    out["varlen_calls"] = calls["varlen"]
    out["packed"] = [(f.cpu(), e.cpu()) for f, e in zip(fused, run(False, qp, kp, vp, wp, packed_seq_params=params))]
    LA.VARLEN_ATTN = kernel
    parallel_state.destroy_model_parallel()
    return T.pack(out)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    from tests.unit.megatron_patches import _tiny_gpt as T

    (out,) = run_distributed(_fused_vs_eager, world_size=1, timeout=300)
    return T.unpack(out)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fused_attention_equals_the_eager_path_in_bf16(result, layout):
    for name, (fused, eager) in zip(("out", "dq", "dk", "dv"), result[layout]):
        scale = eager.abs().max().item()
        torch.testing.assert_close(fused, eager, rtol=0.02, atol=0.02 * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_packed_rows_take_one_varlen_call_where_torch_has_it(result):
    assert result["varlen_calls"] == (1 if result["varlen_available"] else 0), result["torch"]
