"""LocalDotProductAttention at CP=2 equals full-sequence causal attention (values and grads), GQA included;
packed (THD) rows of different lengths equal each row's own causal attention at CP=2 (values and grads);
at CP=1 it equals Megatron's DotProductAttention; and a GPTModel using it at CP=2 gives the CP=1 logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import megatron_patches
from mcore_agentic.parallel.cp_split import cp_positions, cp_split
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches import _tiny_gpt as T

S, B, NP, NG, HN = 16, 2, 4, 2, 8  # GQA: 4 query heads share 2 KV heads


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Full-sequence causal attention via torch SDPA ([S, b, n, h] in, [S, b, n*h] out)."""
    rep = q.shape[2] // k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, NP, HN, generator=g)
    k = torch.randn(S, B, NG, HN, generator=g)
    v = torch.randn(S, B, NG, HN, generator=g)
    w = torch.randn(S, B, NP * HN, generator=g)  # a fixed cotangent so every output element matters
    return q, k, v, w


def _core_attention(cls: type, config: Any):
    from megatron.core.transformer.enums import AttnMaskType

    return cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _cp_body(rank: int, world_size: int) -> bytes:
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mcore_agentic.parallel.local_attention import LocalDotProductAttention

    megatron_patches.apply()
    result: dict[str, Any] = {}

    # --- CP = 2: local rows of the full causal attention, and grads through the K/V all-gather; then packed rows
    # (THD), each segment attending causally within itself, split over CP on its own. Eager, then fused (SDPA). ---
    T.init_parallel(cp=2)
    cp_rank = parallel_state.get_context_parallel_rank()
    for suffix, fused in (("", False), ("_fused", True)):
        attn = _core_attention(LocalDotProductAttention, T.transformer_config())
        if fused:
            _force_fused(attn)
        result["cp2" + suffix] = _cp2_case(attn, cp_rank)
        result["packed" + suffix] = _packed_case(attn, cp_rank, cp=2)

    # --- whole model: GPTModel with this attention at CP=2 gives the CP=1 logits for the local tokens ---
    spec_attn = LocalDotProductAttention
    cp1 = _gpt_logits(cp=1, attention=spec_attn, state=None)
    cp2 = _gpt_logits(cp=2, attention=spec_attn, state=cp1["state"])
    cp_rank = 0 if cp2["cp_rank"] is None else cp2["cp_rank"]
    result["gpt"] = (cp2["logits"], cp_split(cp1["logits"], 2, cp_rank, seq_dim=1))

    # --- CP = 1: identical to Megatron's own local DotProductAttention ---
    parallel_state.destroy_model_parallel()
    T.init_parallel()
    cfg = T.transformer_config()
    q, k, v, w = _inputs()
    ours = _core_attention(LocalDotProductAttention, cfg)(q, k, v, None)
    theirs = _core_attention(DotProductAttention, cfg)(q, k, v, None)
    result["cp1"] = (ours, theirs)
    fused = _force_fused(_core_attention(LocalDotProductAttention, cfg))
    qf = _leaf(q)
    out = fused(qf, k, v, None)
    (out * w).sum().backward()
    qe = _leaf(q)
    (_core_attention(LocalDotProductAttention, cfg)(qe, k, v, None) * w).sum().backward()
    result["cp1_fused"] = {"out": (out.detach(), theirs.detach()), "dq": (qf.grad, qe.grad)}
    result["packed_cp1_fused"] = _packed_case(fused, 0, cp=1)
    result["varlen"] = _varlen_cases(cfg)
    parallel_state.destroy_model_parallel()
    return T.pack(result)


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the eager path ran where the fused one should have")


def _force_fused(attn: Any) -> Any:
    """``attn`` taking the fused kernels on CPU too, its eager path refusing to run."""
    attn.fused_devices = ("cpu", "cuda")
    attn._attend = _refuse
    return attn


def _cp2_case(attn: Any, cp_rank: int) -> dict[str, Any]:
    q, k, v, w = _inputs()
    ql, kl, vl = (_leaf(cp_split(t, 2, cp_rank, seq_dim=0)) for t in (q, k, v))
    out = attn(ql, kl, vl, None)
    (out * cp_split(w, 2, cp_rank, seq_dim=0)).sum().backward()
    qf, kf, vf = _leaf(q), _leaf(k), _leaf(v)
    ref = _reference(qf, kf, vf)
    (ref * w).sum().backward()
    return {
        "out": (out.detach(), cp_split(ref.detach(), 2, cp_rank, seq_dim=0)),
        "dq": (ql.grad, cp_split(qf.grad, 2, cp_rank, seq_dim=0)),
        "dk": (kl.grad, cp_split(kf.grad, 2, cp_rank, seq_dim=0)),
        "dv": (vl.grad, cp_split(vf.grad, 2, cp_rank, seq_dim=0)),
    }


LENS = [4, 12, 8]  # multiples of 2 * CP


def _packed_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    qp, kp, vp = (torch.randn(sum(LENS), n, HN, generator=g).to(dtype) for n in (NP, NG, NG))
    return qp, kp, vp, torch.randn(sum(LENS), NP * HN, generator=g).to(dtype)


def _packed_params(cls: type | None = None, **extra: Any) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return (cls or PackedSeqParams)(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                    cu_seqlens_kv_padded=cu, max_seqlen_q=max(LENS), max_seqlen_kv=max(LENS), **extra)


def _per_row_reference(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, scale: float | None = None):
    refs, start = [], 0
    for n in LENS:
        sl = slice(start, start + n)
        refs.append(_reference(qp[sl].unsqueeze(1), kp[sl].unsqueeze(1), vp[sl].unsqueeze(1), scale).squeeze(1))
        start += n
    return torch.cat(refs)


def _packed_case(attn: Any, cp_rank: int, cp: int) -> dict[str, Any]:
    from mcore_agentic.parallel.cp_split import cp_packed_indices

    params = _packed_params()
    qp, kp, vp, wp = _packed_inputs()
    local = cp_packed_indices(params.cu_seqlens_q, cp, cp_rank)
    qpl, kpl, vpl = (_leaf(t[local]) for t in (qp, kp, vp))
    outp = attn(qpl, kpl, vpl, None, packed_seq_params=params)
    (outp * wp[local]).sum().backward()
    qpf, kpf, vpf = _leaf(qp), _leaf(kp), _leaf(vp)
    refp = _per_row_reference(qpf, kpf, vpf)
    (refp * wp).sum().backward()
    return {
        "out": (outp.detach(), refp.detach()[local]),
        "dq": (qpl.grad, qpf.grad[local]),
        "dk": (kpl.grad, kpf.grad[local]),
        "dv": (vpl.grad, vpf.grad[local]),
    }


def _varlen_standin(style: str, calls: list[dict[str, Any]]):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` (flash: CUDA-only) with one release's signature:
    ``2.9`` (``is_causal``, no scale, no GQA), ``2.11`` (``window_size``, ``scale``, no GQA: read on the H100) or
    ``2.13`` (``window_size``, ``scale``, ``enable_gqa``). It computes what the kernel computes, per segment of
    ``cu_seq_q``, in fp32, and records how it was called."""

    def attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, gqa):
        assert cu_seq_q.dtype == torch.int32 and cu_seq_q is cu_seq_k and max_q == max_k == max(LENS)
        if key.shape[1] != query.shape[1]:
            assert gqa, "GQA keys without enable_gqa"
        calls.append({"style": style, "causal": causal, "scale": scale, "gqa": gqa, "dtype": str(query.dtype)})
        bounds = cu_seq_q.tolist()
        outs = []
        for a, b in zip(bounds, bounds[1:]):
            q, k, v = (t[a:b].transpose(0, 1).float() for t in (query, key, value))
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa).transpose(0, 1))
        return torch.cat(outs).to(query.dtype)

    if style == "2.9":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, False)
    elif style == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, False)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale,
                          enable_gqa)
    return varlen_attn


STYLES = ("2.9", "2.11", "2.13")


def _varlen_cases(cfg: Any) -> dict[str, Any]:
    """Packed rows at CP 1 through the varlen kernel's call (both signatures), bf16, a non-default scale, GQA."""
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_agentic.parallel import local_attention as LA

    out: dict[str, Any] = {}
    saved = LA.VARLEN_ATTN
    try:
        for style in STYLES:
            calls: list[dict[str, Any]] = []
            LA.VARLEN_ATTN = _varlen_standin(style, calls)
            attn = _force_fused(LA.LocalDotProductAttention(
                config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                softmax_scale=0.2,
            ))
            qp, kp, vp, _ = _packed_inputs(torch.bfloat16)
            params = _packed_params(LA.LocalPackedSeqParams, cu_seqlens_device=_packed_params().cu_seqlens_q)
            got = attn(qp, kp, vp, None, packed_seq_params=params)
            want = _per_row_reference(qp.float(), kp.float(), vp.float(), scale=0.2)
            out[style] = {"out": (got.float(), want), "calls": calls}
    finally:
        LA.VARLEN_ATTN = saved
    return out


def _gpt_logits(cp: int, attention: type, state: dict | None) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    parallel_state.destroy_model_parallel()
    T.init_parallel(cp=cp)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = attention
    model = GPTModel(
        config=T.transformer_config(),
        transformer_layer_spec=spec,
        vocab_size=T.VOCAB,
        max_sequence_length=T.SEQ,
        position_embedding_type="rope",
    )
    if state is not None:
        model.load_state_dict(state)
    batch = T.batch()
    tokens, positions = batch["tokens"], batch["position_ids"]
    cp_rank = None
    if cp > 1:
        cp_rank = parallel_state.get_context_parallel_rank()
        tokens = cp_split(tokens, cp, cp_rank, seq_dim=1)
        positions = cp_positions(T.SEQ, cp, cp_rank).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    return {"logits": logits, "state": {k: v for k, v in model.state_dict().items() if v is not None}, "cp_rank": cp_rank}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return [T.unpack(r) for r in run_distributed(_cp_body, 2)]


def _assert_every_rank_close(results: list[dict[str, Any]], case: str, what: str) -> None:
    """Every rank's ``(got, want)`` of ``results[rank][case][what]``: same shape, equal to 1e-5."""
    for rank, res in enumerate(results):
        got, want = res[case][what]
        assert got is not None and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, r=rank: f"rank {r} {what}: {m}")


@pytest.mark.parametrize("fused", ["", "_fused"], ids=["eager", "fused"])
@pytest.mark.parametrize("what", ["out", "dq", "dk", "dv"])
def test_cp2_matches_full_attention(results, what, fused):
    _assert_every_rank_close(results, "cp2" + fused, what)


def test_cp_ranks_hold_different_rows(results):
    assert not torch.equal(results[0]["cp2"]["out"][0], results[1]["cp2"]["out"][0])


def test_gpt_model_cp2_equals_cp1(results):
    for res in results:
        got, want = res["gpt"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cp1_equals_megatron_dot_product_attention(results):
    ours, theirs = results[0]["cp1"]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fused", ["", "_fused"], ids=["eager", "fused"])
@pytest.mark.parametrize("what", ["out", "dq", "dk", "dv"])
def test_packed_rows_match_per_row_attention_at_cp2(results, what, fused):
    _assert_every_rank_close(results, "packed" + fused, what)


def test_the_fused_path_at_cp1_equals_megatron_and_the_eager_path(results):
    for what in ("out", "dq"):
        got, want = results[0]["cp1_fused"][what]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for what in ("out", "dq", "dk", "dv"):
        _assert_every_rank_close(results, "packed_cp1_fused", what)


@pytest.mark.parametrize("style", STYLES)
def test_packed_rows_at_cp1_take_one_varlen_call_with_its_releases_signature(results, style):
    """torch 2.9's ``varlen_attn(..., is_causal)``, 2.11's ``(..., scale=, window_size=)`` and 2.13's ``(...,
    enable_gqa=)``: one call per layer for all rows, causal, the layer's scale (folded into the queries where there
    is no ``scale``), GQA keys expanded where there is no ``enable_gqa``; bf16 against an fp32 reference."""
    case = results[0]["varlen"][style]
    assert len(case["calls"]) == 1
    call = case["calls"][0]
    assert call["causal"] and call["dtype"] == "torch.bfloat16"
    assert call["scale"] == (None if style == "2.9" else 0.2) and call["gqa"] == (style == "2.13")
    got, want = case["out"]
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
