"""HFEngine's prefix reuse: a conversation's next turn prefills only its new ids, with the no-reuse path's samples.

Tolerance: sampled ids equal, log-probs within 1e-4 of the engine without reuse (float32; measured ~6e-6: the
reused keys and values come from an earlier, differently padded forward, so they agree to float rounding).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mcore_agentic.models.tiny import make_tiny_hf_model, make_tiny_hf_model_from_preset
from mcore_agentic.rollout.engines.base import PrefixCacheStats, SamplingParams, prefix_cache_stats
from mcore_agentic.rollout.engines.hf import HFEngine, PrefixStore
from mcore_agentic.rollout.engines.hf_cache import common_prefix
from tests.helpers.hf import redraw_weights

TOLERANCE = 1e-4
SYSTEM = list(range(40, 100))  # a shared "system prompt and tools"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", vocab_size=512, seed=0)


_BUILT: list[HFEngine] = []


@pytest.fixture(autouse=True)
def _shut_down():
    """Each test's engines stop their scheduler threads (one idling as the process exits can abort it)."""
    yield
    while _BUILT:
        _BUILT.pop().shutdown()


def _engine(path, entries: int = 8, nbytes: int = 1 << 30, **kw) -> HFEngine:
    engine = HFEngine.from_pretrained(path, seed=0, prefix_cache_entries=entries, prefix_cache_bytes=nbytes, **kw)
    _BUILT.append(engine)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        redraw_weights(engine.model, 0.3)  # logits with signal: no near-ties for greedy to flip on
    return engine


async def _conversations(engine: HFEngine, starts: list[list[int]], turns: int, temperature: float):
    """Each conversation's turns in step, every turn's requests together (plus a long unrelated request running
    beside the first turns, so reusing rows join a running batch); each turn's prompt is the last prompt + its
    samples + three new ids."""
    background = asyncio.ensure_future(engine.generate([7] * 5, SamplingParams(max_new_tokens=40, seed=99)))
    prompts, outs = [list(s) for s in starts], [[] for _ in starts]
    for turn in range(turns):
        results = await asyncio.gather(*(
            engine.generate(p, SamplingParams(max_new_tokens=5, temperature=temperature, seed=10 * turn + c))
            for c, p in enumerate(prompts)))
        for c, out in enumerate(results):
            outs[c].append((list(prompts[c]), out))
            prompts[c] = prompts[c] + out.token_ids + [200 + turn, 201 + c, 202]
    await background
    return outs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reuse_samples_what_the_no_reuse_path_samples(model_dir, temperature):
    starts = [SYSTEM + [1, 2, 3], SYSTEM[:30] + [4, 5], list(range(300, 311))]
    reuse, plain = _engine(model_dir), _engine(model_dir, entries=0)
    got = asyncio.run(_conversations(reuse, starts, 4, temperature))
    want = asyncio.run(_conversations(plain, starts, 4, temperature))
    for conv_got, conv_want in zip(got, want):
        for (_, a), (_, b) in zip(conv_got, conv_want):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert np.abs(np.array(a.log_probs) - np.array(b.log_probs)).max() <= TOLERANCE
    # ... and both are the model's own log-probs of the sampled ids
    prompt, out = got[0][-1]
    with torch.no_grad():
        logits = reuse.model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    logits[:, reuse.suppress_token_ids] = float("-inf")
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(out.log_probs), atol=TOLERANCE, rtol=0)
    # every later turn reused its conversation's whole previous sequence: it prefilled its 3 new ids + the last sample
    stats, none = reuse.prefix_cache_stats(), plain.prefix_cache_stats()
    assert stats.prompt_tokens == none.prompt_tokens and none.cached_tokens == 0
    fed_before = sum(len(p) + len(o.token_ids) - 1 for conv in got for p, o in conv[:-1])
    assert stats.cached_tokens >= fed_before  # + the system prompt the second conversation shared at its first turn


def test_a_turn_prefills_only_its_new_ids(model_dir):
    engine = _engine(model_dir)
    prompt = SYSTEM + [1, 2]

    async def main():
        readings, before = [], engine.prefix_cache_stats()
        nonlocal prompt
        for turn in range(3):
            out = await engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=turn))
            now = engine.prefix_cache_stats()
            readings.append((len(prompt), len(out.token_ids), now - before))
            before = now
            prompt = prompt + out.token_ids + [210, 211, 212, 213, 214]
        return readings

    readings = asyncio.run(main())
    assert readings[0][2] == PrefixCacheStats(len(SYSTEM) + 2, 0)
    for (prev_len, prev_out, _), (_, _, delta) in zip(readings, readings[1:]):
        assert delta.cached_tokens == prev_len + prev_out - 1  # all it fed; its last sample was never fed
        assert delta.prefilled_tokens == 5 + 1  # the new ids and that last sample
    assert prefix_cache_stats(engine) == engine.prefix_cache_stats()


def test_another_conversation_reuses_the_shared_system_prompt(model_dir):
    engine = _engine(model_dir)
    asyncio.run(engine.generate(SYSTEM + [1, 2, 3], SamplingParams(max_new_tokens=3, seed=0)))
    before = engine.prefix_cache_stats()
    asyncio.run(engine.generate(SYSTEM + [9, 8], SamplingParams(max_new_tokens=3, seed=1)))
    assert (engine.prefix_cache_stats() - before).cached_tokens == len(SYSTEM)
    before = engine.prefix_cache_stats()  # sharing less than half its prompt: prefilled whole, in the fresh batch
    asyncio.run(engine.generate(SYSTEM[:10] + list(range(300, 320)), SamplingParams(max_new_tokens=3, seed=2)))
    assert (engine.prefix_cache_stats() - before).cached_tokens == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prompt_admitted_several_times_at_once_is_computed_once(model_dir, temperature):
    prompts = [SYSTEM, SYSTEM, list(range(300, 320)), SYSTEM]  # a group's samples, and another prompt

    def run(engine):
        async def main():
            return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=6, temperature=temperature,
                                                                            seed=i)) for i, p in enumerate(prompts)))
        return asyncio.run(main())

    shared, plain = _engine(model_dir, batch_window_s=0.2), _engine(model_dir, entries=0, batch_window_s=0.2)
    got, want = run(shared), run(plain)
    assert shared.prefills_run == plain.prefills_run == 1  # one forward: 2 rows instead of 4
    assert shared.prefix_cache_stats() == PrefixCacheStats(3 * len(SYSTEM) + 20, 2 * len(SYSTEM))
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and np.abs(np.array(a.log_probs) - np.array(b.log_probs)).max() <= TOLERANCE
    if temperature > 0:  # each sample still draws from its own seed
        assert len({tuple(o.token_ids) for o in (got[0], got[1], got[3])}) == 3


def test_the_store_is_bounded_and_dropped_with_the_weights(model_dir):
    engine = _engine(model_dir, entries=2)

    def run(prompt, n=3):
        return asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=n, seed=0)))

    first = run([5, 6, 7, 8])
    run([5, 6, 7, 8] + first.token_ids + [9])  # extends the first: replaces it
    assert len(engine.prefix_store.entries) == 1
    run([30, 31, 32])
    run([40, 41, 42])
    assert len(engine.prefix_store.entries) == 2 and engine.prefix_store.dropped == 1  # the LRU one went
    assert engine.prefix_store.nbytes == sum(e.nbytes for e in engine.prefix_store.entries) > 0
    engine.flush_cache()
    assert not engine.prefix_store.entries and engine.prefix_store.nbytes == 0
    run([40, 41, 42])
    engine.update_weights(list(engine.model.state_dict().items())[:1], version=1)  # new weights: old caches go
    assert not engine.prefix_store.entries
    tiny = _engine(model_dir, nbytes=1000)  # a 6-token cache of this model takes 6 * 2 layers * 2 * 64 * 4 bytes
    asyncio.run(tiny.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=3, seed=0)))
    assert not tiny.prefix_store.entries and tiny.prefix_store.dropped == 1
    off = _engine(model_dir, entries=0)
    asyncio.run(off.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=3, seed=0)))
    assert not off.prefix_store.entries and off.prefix_cache_stats() == PrefixCacheStats(4, 0)


def test_lookup_keeps_the_last_prompt_id_to_feed():
    store = PrefixStore(4, 1 << 20)
    kv = ((torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2)),)
    store.add(np.array([1, 2, 3, 4, 5]), kv, None)
    assert store.lookup(np.array([1, 2, 3, 4, 5]))[1] == 4  # the same prompt again: its last id is fed
    assert store.lookup(np.array([1, 2, 3, 4, 5, 6, 7]))[1] == 5
    assert store.lookup(np.array([1, 2, 9]))[1] == 2
    assert store.lookup(np.array([9, 9]))[0] is None
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2 and common_prefix(np.array([]), np.array([1])) == 0


def test_routed_experts_of_reused_tokens_come_with_the_cache(tmp_path):
    path = make_tiny_hf_model_from_preset(tmp_path / "moe", "tiny_moe", vocab_size=512)
    outs = []
    for entries in (4, 0):
        engine = _engine(path, entries=entries, record_routing=True)

        async def two_turns(engine=engine):
            first = await engine.generate(SYSTEM, SamplingParams(max_new_tokens=4, temperature=0.0))
            prompt = SYSTEM + first.token_ids + [210, 211]
            return prompt, await engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0.0))

        outs.append(asyncio.run(two_turns()))
        assert engine.prefix_cache_stats().cached_tokens == (len(SYSTEM) + 3 if entries else 0)
    (prompt, reused), (_, plain) = outs
    assert reused.token_ids == plain.token_ids
    assert reused.routed_experts.shape == (len(prompt) + len(reused.token_ids) - 1, *plain.routed_experts.shape[1:])
    assert np.array_equal(reused.routed_experts, plain.routed_experts)
