"""Tests for vocab-parallel log-prob/entropy: values and gradients vs a full-vocab reference.

Single process (group=None) and 2 gloo TP ranks, temperatures 1.0 and 0.7, a padded
vocabulary excluded by ``vocab_size`` or by -inf logits.
"""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.parallel.vocab_parallel import (
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)
from tests.helpers.distributed import run_distributed

PADDED_VOCAB, TRUE_VOCAB = 12, 11  # one padded id at the end, like Megatron's vocab padding


def _reference(logits: torch.Tensor, target: torch.Tensor, temperature: float, vocab_size: int):
    """Plain full-vocabulary log_softmax / entropy in float64, padded ids dropped."""
    lsm = torch.log_softmax(logits[..., :vocab_size].double() / temperature, dim=-1)
    log_prob = lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    return log_prob, entropy


def _inputs(seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, 5, PADDED_VOCAB, generator=gen) * 3).to(dtype)
    target = torch.randint(0, TRUE_VOCAB, (2, 5), generator=gen)
    weights = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64)  # loss = sum(w0 * lp + w1 * H)
    return logits, target, weights


def _grads(logits, target, weights, temperature, fn):
    leaf = logits.detach().clone().requires_grad_(True)
    log_prob, entropy = fn(leaf, target, temperature)
    loss = (weights[0] * log_prob.double()).sum() + (weights[1] * entropy.double()).sum()
    loss.backward()
    return log_prob.detach(), entropy.detach(), leaf.grad


def _ref_fn(leaf, target, temperature):
    return _reference(leaf, target, temperature, TRUE_VOCAB)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [None, 3])
def test_single_process_matches_reference(temperature, chunk_tokens):
    logits, target, weights = _inputs()

    def ours(leaf, tgt, t):
        return vocab_parallel_log_probs_and_entropy(
            leaf, tgt, group=None, temperature=t, vocab_size=TRUE_VOCAB, chunk_tokens=chunk_tokens
        )

    lp, ent, grad = _grads(logits, target, weights, temperature, ours)
    ref_lp, ref_ent, ref_grad = _grads(logits, target, weights, temperature, _ref_fn)
    assert lp.dtype == torch.float32 and lp.shape == target.shape
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    assert torch.allclose(grad.double(), ref_grad.float().double(), atol=1e-5)
    assert (grad[..., TRUE_VOCAB:] == 0).all()


def test_separate_functions_and_inf_padding():
    logits, target, _ = _inputs(1)
    padded = logits.clone()
    padded[..., TRUE_VOCAB:] = float("-inf")  # the other way to exclude padding
    ref_lp, ref_ent = _reference(logits, target, 0.7, TRUE_VOCAB)
    leaf = padded.clone().requires_grad_(True)
    lp = vocab_parallel_log_probs(leaf, target, group=None, temperature=0.7)
    _, ent = vocab_parallel_log_probs_and_entropy(leaf, target, group=None, temperature=0.7)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[..., TRUE_VOCAB:] == 0).all()


def test_gradcheck_float64_with_padding_and_temperature():
    logits, target, weights = _inputs(2, dtype=torch.float64)
    leaf = logits[0].clone().requires_grad_(True)

    def fn(x):
        lp, ent = vocab_parallel_log_probs_and_entropy(
            x, target[0], group=None, temperature=0.7, vocab_size=TRUE_VOCAB, chunk_tokens=2
        )
        return lp, ent

    assert torch.autograd.gradcheck(fn, (leaf,))
    # only one output used: the other's gradient arrives as None and is skipped
    assert torch.autograd.gradcheck(lambda x: fn(x)[0], (leaf,))
    assert torch.autograd.gradcheck(lambda x: fn(x)[1], (leaf,))


def test_bf16_logits_compute_in_fp32():
    logits, target, weights = _inputs(3, dtype=torch.bfloat16)
    lp, ent, grad = _grads(
        logits, target, weights, 1.0, lambda x, t, temp: vocab_parallel_log_probs_and_entropy(x, t, group=None)
    )
    ref_lp, ref_ent = _reference(logits.float(), target, 1.0, PADDED_VOCAB)
    assert grad.dtype == torch.bfloat16 and lp.dtype == torch.float32
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)


def test_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), group=None, temperature=0.0)


def _tp_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    local = PADDED_VOCAB // world_size
    logits, target, weights = _inputs(4)
    out = {}
    for temperature in (1.0, 0.7):
        ref_lp, ref_ent, ref_grad = _grads(logits, target, weights, temperature, _ref_fn)
        shard_slice = slice(rank * local, (rank + 1) * local)
        for padding in ("vocab_size", "-inf"):
            shard = logits[..., shard_slice].clone()
            if padding == "-inf" and rank == world_size - 1:
                shard[..., TRUE_VOCAB - rank * local :] = float("-inf")
            vocab_size = TRUE_VOCAB if padding == "vocab_size" else None

            def ours(leaf, tgt, t, vocab_size=vocab_size):
                return vocab_parallel_log_probs_and_entropy(
                    leaf, tgt, group=group, temperature=t, vocab_size=vocab_size, chunk_tokens=4
                )

            lp, ent, grad = _grads(shard, target, weights, temperature, ours)
            key = f"T={temperature},{padding}"
            out[key + ",lp_err"] = (lp.double() - ref_lp).abs().max().item()
            out[key + ",ent_err"] = (ent.double() - ref_ent).abs().max().item()
            out[key + ",grad_err"] = (grad.double() - ref_grad[..., shard_slice]).abs().max().item()
            out[key + ",finite"] = bool(torch.isfinite(grad).all())
        # the log-prob-only wrapper on TP too
        shard = logits[..., shard_slice]
        lp_only = vocab_parallel_log_probs(shard, target, group=group, temperature=temperature, vocab_size=TRUE_VOCAB)
        out[f"T={temperature},wrappers_err"] = (lp_only.double() - ref_lp).abs().max().item()

    # Cross-check against Megatron-core's own vocab-parallel cross entropy (T=1, no padding): loss == -log p.
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    shard = logits[..., rank * local : (rank + 1) * local]
    theirs = shard.clone().requires_grad_(True)
    mine = shard.clone().requires_grad_(True)
    mg_loss = vocab_parallel_cross_entropy(theirs, target)
    lp = vocab_parallel_log_probs(mine, target, group=parallel_state.get_tensor_model_parallel_group())
    (weights[0].float() * mg_loss).sum().backward()
    (-weights[0].float() * lp).sum().backward()
    out["megatron_value_err"] = (mg_loss + lp).abs().max().item()
    out["megatron_grad_err"] = (theirs.grad - mine.grad).abs().max().item()
    return out


def test_two_tp_ranks_match_full_vocab_reference():
    results = run_distributed(_tp_body, world_size=2)
    for rank, res in enumerate(results):
        for key, value in res.items():
            if key.endswith("finite"):
                assert value, (rank, key)
            else:
                assert value < 1e-5, (rank, key, value)
