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


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full-sequence causal attention via torch SDPA ([S, b, n, h] in, [S, b, n*h] out)."""
    rep = q.shape[2] // k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
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

    # --- CP = 2: local rows of the full causal attention, and grads through the K/V all-gather ---
    T.init_parallel(cp=2)
    cp_rank = parallel_state.get_context_parallel_rank()
    attn = _core_attention(LocalDotProductAttention, T.transformer_config())
    q, k, v, w = _inputs()
    ql, kl, vl = (_leaf(cp_split(t, 2, cp_rank, seq_dim=0)) for t in (q, k, v))
    out = attn(ql, kl, vl, None)
    (out * cp_split(w, 2, cp_rank, seq_dim=0)).sum().backward()

    qf, kf, vf = _leaf(q), _leaf(k), _leaf(v)
    ref = _reference(qf, kf, vf)
    (ref * w).sum().backward()
    result["cp2"] = {
        "out": (out.detach(), cp_split(ref.detach(), 2, cp_rank, seq_dim=0)),
        "dq": (ql.grad, cp_split(qf.grad, 2, cp_rank, seq_dim=0)),
        "dk": (kl.grad, cp_split(kf.grad, 2, cp_rank, seq_dim=0)),
        "dv": (vl.grad, cp_split(vf.grad, 2, cp_rank, seq_dim=0)),
    }

    # --- packed rows (THD): each segment attends causally within itself, split over CP on its own ---
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_agentic.parallel.cp_split import cp_packed_indices

    lens = [4, 12, 8]  # multiples of 2 * CP
    cu = torch.tensor([0, 4, 16, 24], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    qp, kp, vp = (torch.randn(24, n, HN, generator=g) for n in (NP, NG, NG))
    wp = torch.randn(24, NP * HN, generator=g)
    local = cp_packed_indices(cu, 2, cp_rank)
    qpl, kpl, vpl = (_leaf(t[local]) for t in (qp, kp, vp))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=12, max_seqlen_kv=12)
    outp = attn(qpl, kpl, vpl, None, packed_seq_params=params)
    (outp * wp[local]).sum().backward()
    qpf, kpf, vpf = _leaf(qp), _leaf(kp), _leaf(vp)
    refs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        refs.append(_reference(qpf[sl].unsqueeze(1), kpf[sl].unsqueeze(1), vpf[sl].unsqueeze(1)).squeeze(1))
        start += n
    refp = torch.cat(refs)
    (refp * wp).sum().backward()
    result["packed"] = {
        "out": (outp.detach(), refp.detach()[local]),
        "dq": (qpl.grad, qpf.grad[local]),
        "dk": (kpl.grad, kpf.grad[local]),
        "dv": (vpl.grad, vpf.grad[local]),
    }

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
    ours = _core_attention(LocalDotProductAttention, cfg)(q, k, v, None)
    theirs = _core_attention(DotProductAttention, cfg)(q, k, v, None)
    result["cp1"] = (ours, theirs)
    parallel_state.destroy_model_parallel()
    return T.pack(result)


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


@pytest.mark.parametrize("what", ["out", "dq", "dk", "dv"])
def test_cp2_matches_full_attention(results, what):
    _assert_every_rank_close(results, "cp2", what)


def test_cp_ranks_hold_different_rows(results):
    assert not torch.equal(results[0]["cp2"]["out"][0], results[1]["cp2"]["out"][0])


def test_gpt_model_cp2_equals_cp1(results):
    for res in results:
        got, want = res["gpt"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cp1_equals_megatron_dot_product_attention(results):
    ours, theirs = results[0]["cp1"]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("what", ["out", "dq", "dk", "dv"])
def test_packed_rows_match_per_row_attention_at_cp2(results, what):
    _assert_every_rank_close(results, "packed", what)
