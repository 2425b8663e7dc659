"""HFEngine: batched sampling whose logprobs match a teacher-forced forward, seeds, weight sync, memory."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore_agentic.models.tiny import make_tiny_hf_model
from mcore_agentic.rollout.engines.base import GenerationOutput, RolloutEngine, SamplingParams
from mcore_agentic.rollout.engines.hf import HFEngine, sample_token


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_hf_model(root / "a", vocab_size=512, seed=0), make_tiny_hf_model(root / "b", vocab_size=512, seed=1)


@pytest.fixture()
def engine(model_dirs):
    return HFEngine.from_pretrained(model_dirs[0], seed=0)


def _teacher_forced(model, suppress, prompt, out: GenerationOutput, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logits[:, suppress] = float("-inf")
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]


def _gather(engine, prompts, params_list):
    async def main():
        return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params_list)))

    return asyncio.run(main())


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, -1), (0.7, 0.9, 50), (0.0, 1.0, -1)])
def test_batched_logprobs_match_teacher_forcing(engine, temperature, top_p, top_k):
    assert isinstance(engine, RolloutEngine)
    params = [
        SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=i) for i in range(3)
    ]
    outs = _gather(engine, PROMPTS, params)
    assert engine.prefills_run == 1 and engine.max_rows_per_step == 3  # the concurrent requests shared steps
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        ref = _teacher_forced(engine.model, engine.suppress_token_ids, prompt, out, temperature)
        assert torch.allclose(ref, torch.tensor(out.log_probs), atol=1e-4, rtol=0)
        assert all(t not in engine.suppress_token_ids for t in out.token_ids)
    if temperature == 0:  # greedy: every token is the argmax
        prompt, out = PROMPTS[0], outs[0]
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        logits[:, engine.suppress_token_ids] = float("-inf")
        assert logits.argmax(-1).tolist() == out.token_ids


def test_seed_determines_output_regardless_of_batching(engine):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=123)
    alone = _gather(engine, [PROMPTS[1]], [sp])[0]
    batched = _gather(engine, PROMPTS, [SamplingParams(max_new_tokens=5, seed=9), sp, SamplingParams(max_new_tokens=7)])[1]
    assert alone.token_ids == batched.token_ids
    other = _gather(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=10, temperature=1.0, seed=124)])[0]
    assert other.token_ids != alone.token_ids


def test_request_joins_a_running_batch(engine):
    """Continuous batching: a request arriving mid-flight joins the running batch and may finish first."""
    long_params = SamplingParams(max_new_tokens=200, seed=1)
    short_params = SamplingParams(max_new_tokens=6, seed=2)

    async def main():
        long = asyncio.create_task(engine.generate(PROMPTS[0], long_params))
        while engine.steps_run < 5:  # the long request is decoding
            await asyncio.sleep(0.001)
        short = await engine.generate(PROMPTS[2], short_params)
        return short, long.done(), await long

    short, long_done_first, long = asyncio.run(main())
    assert not long_done_first
    assert engine.prefills_run == 2 and engine.max_rows_per_step == 2
    for prompt, out in ((PROMPTS[0], long), (PROMPTS[2], short)):
        ref = _teacher_forced(engine.model, engine.suppress_token_ids, prompt, out, 1.0)
        assert torch.allclose(ref, torch.tensor(out.log_probs), atol=1e-4, rtol=0)
    assert _gather(engine, [PROMPTS[2]], [short_params])[0].token_ids == short.token_ids


def test_stop_tokens_end_generation(engine):
    everything = list(range(engine.model.config.vocab_size))
    out = _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=10, stop_token_ids=everything, seed=0)])[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1


def test_sample_token_filters():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    gen = torch.Generator().manual_seed(0)
    draws = {sample_token(logits, SamplingParams(max_new_tokens=1, top_k=2), gen)[0] for _ in range(200)}
    assert draws == {2, 3}
    # top_p=0.5: token 3 alone holds ~64% of the mass
    draws = {sample_token(logits, SamplingParams(max_new_tokens=1, top_p=0.5), gen)[0] for _ in range(100)}
    assert draws == {3}
    token, lp = sample_token(logits, SamplingParams(max_new_tokens=1, temperature=0.5, top_k=1), gen)
    assert token == 3 and lp == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[3]))


def test_update_weights_strict_and_effective(engine, model_dirs):
    other = AutoModelForCausalLM.from_pretrained(str(model_dirs[1]), dtype=torch.float32)
    named = list(other.state_dict().items())
    with pytest.raises(KeyError, match="not in the engine"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))], version=1)
    name, tensor = named[0]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(name, torch.zeros(tensor.shape[0] + 1))], version=1)
    engine.update_weights(named[:3], version=1)  # one bucket...
    with pytest.raises(ValueError, match="left .* tensors unset"):
        engine.finish_weight_update(1)  # ...is not a whole sync
    assert engine.weight_version == 0
    half = len(named) // 2
    engine.update_weights(named[:half], version=1)
    engine.update_weights(named[half:], version=1)
    engine.finish_weight_update(1)
    assert engine.weight_version == 1
    out = _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=8, seed=3)])[0]
    ref = _teacher_forced(other, engine.suppress_token_ids, PROMPTS[0], out, 1.0)
    assert torch.allclose(ref, torch.tensor(out.log_probs), atol=1e-4, rtol=0)


def test_release_and_resume_memory(engine):
    before = _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, seed=5)])[0]
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.release_memory()
    assert all(p.device.type == "meta" for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="released"):
        _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, seed=5)])
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.update_weights(list(saved.items()), version=2)
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="before a weight sync"):
        _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, seed=5)])
    engine.update_weights(list(saved.items()), version=2)
    engine.finish_weight_update(2)
    after = _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, seed=5)])[0]
    assert after.token_ids == before.token_ids
    assert after.log_probs == pytest.approx(before.log_probs, abs=1e-5)
    engine.flush_cache()  # nothing cached between batches; must not fail


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, -1), (0.8, 0.9, 40), (0.0, 1.0, -1)])
def test_a_generation_cut_at_any_token_and_continued_equals_the_uncut_one(engine, temperature, top_p, top_k):
    """Mid-turn partial rollouts: the first ``k`` tokens, then the rest from ``prompt + those`` with
    ``draws_before=k``, give the uncut generation's ids, with its logprobs (fp32, same weights)."""
    prompt, n = PROMPTS[0], 16

    def params(max_new: int, before: int = 0) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, seed=7,
                              draws_before=before)

    whole = _gather(engine, [prompt], [params(n)])[0]
    for k in (1, 6, n - 1):
        head = _gather(engine, [prompt], [params(k)])[0]
        tail = _gather(engine, [prompt + head.token_ids], [params(n - k, k)])[0]
        assert head.token_ids + tail.token_ids == whole.token_ids, k
        assert head.log_probs + tail.log_probs == pytest.approx(whole.log_probs, abs=1e-5)


def test_a_cut_generation_continues_under_new_weights_from_its_exact_ids(engine, model_dirs):
    prompt = PROMPTS[2]
    head = _gather(engine, [prompt], [SamplingParams(max_new_tokens=5, seed=3)])[0]
    other = AutoModelForCausalLM.from_pretrained(model_dirs[1], torch_dtype=torch.float32)
    engine.update_weights(other.state_dict().items(), version=1)
    engine.finish_weight_update(1)
    tail = _gather(engine, [prompt + head.token_ids], [SamplingParams(max_new_tokens=7, seed=3, draws_before=5)])[0]
    assert len(tail.token_ids) == 7
    # the continuation's logprobs are the new weights' over the whole kept prefix
    ref = _teacher_forced(other, engine.suppress_token_ids, prompt + head.token_ids, tail, 1.0)
    assert torch.allclose(ref, torch.tensor(tail.log_probs), atol=1e-4, rtol=0)


def test_shutdown_waits_for_the_scheduler_thread_and_fails_what_it_held(model_dirs):
    """The scheduler thread otherwise idles ``idle_exit_s`` after the last request; still alive as the process
    exits, it can free the model's tensors after the GIL is gone (the process aborts after a finished run)."""
    engine = HFEngine.from_pretrained(model_dirs[0], seed=0, idle_exit_s=60.0)
    assert _gather(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=3, seed=0)])[0].finish_reason == "length"
    thread = engine._thread
    assert thread is not None and thread.is_alive()  # idling, waiting for the next request

    async def cut_short():
        running = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=10_000, seed=1)))
        while engine.steps_run < 3:  # decoding
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.shutdown)
        return await asyncio.gather(running, return_exceptions=True)

    (result,) = asyncio.run(cut_short())
    assert isinstance(result, RuntimeError) and "shut down" in str(result)
    assert not thread.is_alive() and engine._thread is None
    with pytest.raises(RuntimeError, match="after shutdown"):
        _gather(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=3)])
    engine.shutdown()  # again: nothing to stop


def test_abort_drops_the_named_row_and_answers_with_what_it_sampled(engine):
    """``abort([id])``: that request leaves the running batch at the next step (its caller gets the tokens it sampled,
    the uncut run's, finish abort); the others go on. An id aborted before its request arrives is answered at once;
    ``abort()`` ends every request issued before it, not the later ones."""
    long = SamplingParams(max_new_tokens=1000, seed=1)

    async def main():
        cut = asyncio.create_task(engine.generate(PROMPTS[0], long, request_id="a"))
        other = asyncio.create_task(engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=30, seed=2),
                                                    request_id="b"))
        while engine.steps_run < 3:
            await asyncio.sleep(0.001)
        engine.abort(["a"])
        results = [await cut, await other]
        prefills = engine.prefills_run
        engine.abort(["later"])
        results.append(await engine.generate(PROMPTS[2], long, request_id="later"))
        assert engine.prefills_run == prefills  # never reached the model
        steps = engine.steps_run
        everything = [asyncio.create_task(engine.generate(p, long)) for p in PROMPTS[:2]]
        while engine.steps_run < steps + 3:
            await asyncio.sleep(0.001)
        engine.abort()
        results += await asyncio.gather(*everything)
        results.append(await engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=3, seed=4)))  # after abort()
        return results

    cut, other, later, *everything, after = asyncio.run(main())
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < long.max_new_tokens
    assert len(cut.log_probs) == len(cut.token_ids)
    uncut = _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=len(cut.token_ids), seed=1)])[0]
    assert uncut.token_ids == cut.token_ids
    assert torch.allclose(torch.tensor(uncut.log_probs), torch.tensor(cut.log_probs), atol=1e-5, rtol=0)
    assert other.finish_reason == "length" and len(other.token_ids) == 30
    assert (later.finish_reason, later.token_ids, later.log_probs) == ("abort", [], [])
    assert [o.finish_reason for o in everything] == ["abort", "abort"]
    assert after.finish_reason == "length" and len(after.token_ids) == 3
    engine.release_memory()  # nothing left generating


def test_drain_aborts_everything_and_waits_until_the_scheduler_holds_nothing(engine):
    """What the sharding manager can call before ``release_memory`` (which refuses while a request generates)."""

    async def main():
        running = [asyncio.create_task(engine.generate(p, SamplingParams(max_new_tokens=1000, seed=i)))
                   for i, p in enumerate(PROMPTS)]
        while engine.steps_run < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="while 3 requests are generating"):
            engine.release_memory()
        assert await asyncio.to_thread(engine.drain, 30.0)
        return await asyncio.gather(*running)

    assert [o.finish_reason for o in asyncio.run(main())] == ["abort"] * 3
    engine.release_memory()
    assert engine.drain(0.0)  # idle: nothing to wait for
