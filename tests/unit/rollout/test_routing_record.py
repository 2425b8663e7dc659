"""Routed experts in the rollout: token-in/token-out, aligned with the trajectory through tool turns.

The engine returns one routing row per token it fed (the prompt, then every sampled token but the last). The
trajectory keeps the row of the first call that fed each token (what a prefix cache keeps), so the
environment tokens appended by delta tokenization, and the last sampled token of a turn, get theirs from the
next call; the last token of the conversation, never fed, stays -1 (unknown). The scripted engine's rows
name the token, position and call that produced them, so any misalignment shows.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from mcore_agentic.rollout.request import Trajectory
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call


def test_trajectory_keeps_the_first_routing_of_each_token_and_cuts_it_with_the_ids():
    t = Trajectory()
    t.set_prompt([1, 2, 3])
    assert t.routed_experts is None  # nothing recorded: a dense engine's trajectory has none
    first = np.arange(3 * 4, dtype=np.int16).reshape(3, 2, 2)
    t.record_routing(first)
    t.append([4, 5], sampled=True, log_probs=[-1.0, -1.0])
    assert t.routed_experts.shape == (5, 2, 2) and (t.routed_experts[3:] == -1).all()
    later = np.full((5, 2, 2), 7, dtype=np.int16)
    t.record_routing(later)  # a later call re-fed tokens 0..2: they keep the first rows
    assert np.array_equal(t.routed_experts[:3], first) and (t.routed_experts[3:] == 7).all()
    t.record_routing(np.zeros((9, 2, 2), dtype=np.int16), start=4)  # rows past the ids are dropped
    t.truncate(4)
    assert t.routed_experts.shape == (4, 2, 2)
    with pytest.raises(ValueError, match="per token"):
        t.record_routing(np.zeros((1, 3, 2), dtype=np.int16))


def test_routing_stays_aligned_with_the_ids_through_tool_turns():
    tokenizer = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    rows = [{"prompt": [{"role": "user", "content": "Q-a: 2+3?"}], "data_source": "t", "reward_model": {"ground_truth": "5"},
             "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"ground_truth": "5"}}}}}]
    cfg = RolloutConfig(n=2, prompt_length=400, response_length=96, multi_turn=MultiTurnConfig(max_assistant_turns=3))
    engine = ScriptedEngine(tokenizer, {"Q-a": [call("add", a=2, b=3), call("add", a=1, b=1), "It is 5."]}, routing=True)
    batch = asyncio.run(generate_sequences(rows, engine, {"add": AddTool()}, None, cfg, tokenizer))
    routed, attn, ids = batch["routed_experts"], batch["attention_mask"].bool(), batch["input_ids"]
    assert routed.dtype == torch.int16 and routed.shape == (*ids.shape, 2, 2)
    assert bool((routed[~attn] == -1).all())  # padding
    for i in range(len(batch)):
        real, tokens = routed[i][attn[i]], ids[i][attn[i]]
        assert batch["num_turns"][i] == 3 and len(tokens) > 40
        fed = real[:-1]
        assert torch.equal(fed[:, 0, 0].long(), tokens[:-1]) and torch.equal(
            fed[:, 0, 1].long(), torch.arange(len(tokens) - 1))  # each row is its own token's, at its position
        assert bool((real[-1] == -1).all())  # the last sampled token was never fed
        calls = fed[:, 1, 1].long()
        # First call wins: non-decreasing over positions, three turns' worth of calls (the n=2 samples interleave).
        assert bool((calls[1:] >= calls[:-1]).all()) and len(torch.unique(calls)) == 3
        mask = batch["response_mask"][i].bool()
        p = batch["prompts"].shape[1]
        turn_starts = [j for j in range(1, mask.numel()) if mask[j] and not mask[j - 1]]
        for j in turn_starts:  # the env tokens before a turn and the turn's first token: fed by one and the same call
            col = p + j - int((~attn[i][:p]).sum())  # position in the real tokens
            assert calls[col - 1] == calls[col]


def test_hf_engine_records_what_a_full_forward_routes(tmp_path):
    """The transformers engine's rows (prefill of left-padded prompts sharing a batch, then one decoding step per
    token) are the experts a plain forward over prompt + samples picks, token by token (fp32)."""
    from transformers import AutoModelForCausalLM

    from mcore_agentic.rollout.engines.base import SamplingParams
    from mcore_agentic.rollout.engines.hf import HFEngine
    from tests.unit.models._hf_fixtures import make_tiny_hf

    path = make_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "moe")
    engine = HFEngine.from_pretrained(path, record_routing=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]

    async def run():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=n, seed=i))
                                      for i, (p, n) in enumerate(zip(prompts, (6, 4)))])

    outs = asyncio.run(run())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda m, a, o: seen.append(o[2]))
    for prompt, out in zip(prompts, outs):
        fed = prompt + out.token_ids[:-1]
        assert out.routed_experts.shape == (len(fed), 2, 2) and out.routed_experts.dtype == np.int16
        seen.clear()
        with torch.no_grad():
            model(torch.tensor([fed]))
        want = torch.stack(seen, 1).sort(-1).values
        assert torch.equal(torch.from_numpy(out.routed_experts).long().sort(-1).values, want)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        HFEngine.from_pretrained(make_tiny_hf("Qwen3ForCausalLM", tmp_path / "dense"), record_routing=True)
