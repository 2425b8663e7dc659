"""SGLangEngine's translation to and from sglang.Engine, without a GPU or SGLang installed.

The stand-in below behaves like SGLang 0.5.23's ``sglang.Engine`` (read from its source:
``srt/entrypoints/engine.py``, ``srt/managers/scheduler_components/weight_updater.py``,
``srt/managers/tokenizer_control_mixin.py``, ``srt/managers/tokenizer_manager.py``):
weight updates only inside a ``begin_weight_update``/``end_weight_update`` session,
``(success, message)`` results, a ``FlushCacheReqOutput``-like ``flush_cache`` result, None from the
memory calls (per memory type: ``kv_cache``, ``weights``, ``cuda_graph``), result dicts without ``text`` under
``skip_tokenizer_init``, a constructor that rejects keys that are no ``ServerArgs`` field and, like
``_set_envs_and_config``, installs a SIGQUIT handler that kills the process tree and writes NCCL variables
into the environment, and a tokenizer manager that adds SIGTERM/SIGQUIT handlers to its event loop at its
first call, knows a request's ``rid`` once it has tokenized it (``rid_to_state``), ends one on ``abort_request(rid)``
with finish ``abort``, and whose scheduler refuses to release memory while a request is live (SGLang asserts
``is_fully_idle()`` there, and the failed assertion SIGQUITs the trainer). ``test_engines_sglang_api.py`` checks the adapter against the real classes where SGLang is installed.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import logging
import os
import signal
import sys
import threading
import types

import numpy as np
import pytest
import torch

from mcore_agentic.rollout.engines.base import PrefixCacheStats, SamplingParams
from mcore_agentic.rollout.engines.sglang import SGLangEngine
from mcore_agentic.rollout.engines.sglang_io import (
    from_sglang_output,
    sglang_engine_kwargs,
    sglang_env_flag,
    to_sglang_request,
    to_sglang_sampling_params,
)

# Real ServerArgs fields of SGLang 0.5.23 (a subset of its 546: msgspec.structs.fields(ServerArgs)).
SERVER_ARGS_FIELDS = frozenset(
    """model_path tokenizer_path tp_size dp_size base_gpu_id gpu_id_step dtype mem_fraction_static
    skip_tokenizer_init enable_memory_saver enable_weights_cpu_backup enable_deterministic_inference
    random_seed log_level port host nccl_port dist_init_addr nnodes node_rank sampling_backend
    attention_backend load_format context_length max_running_requests max_total_tokens
    chunked_prefill_size disable_radix_cache trust_remote_code kv_cache_dtype quantization
    schedule_policy sampling_defaults preferred_sampling_params rl_on_policy_target
    enable_return_routed_experts""".split()
)
# API fields of SGLang 0.5.23's srt/sampling/sampling_params.py::SamplingParams.
SAMPLING_PARAMS_FIELDS = frozenset(
    """max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty
    presence_penalty repetition_penalty min_new_tokens n beam_width json_schema regex ebnf structural_tag
    ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias
    sampling_seed custom_params watermark""".split()
)
# Keyword arguments of SGLang 0.5.23's Engine.async_generate that the adapter may use.
ASYNC_GENERATE_KWARGS = frozenset(
    """prompt sampling_params input_ids return_logprob logprob_start_len top_logprobs_num token_ids_logprob
    lora_path stream rid return_routed_experts""".split()
)
NO_SESSION = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
MEMORY_TYPES = ["kv_cache", "weights", "cuda_graph"]  # srt/constants.py::GPU_MEMORY_ALL_TYPES
KILLED: list[str] = []  # what SGLang's handlers would have done: kill_process_tree(os.getpid())
CONTAINED_SIGNALS = (signal.SIGQUIT, signal.SIGTERM)


def _kill_process_tree(phase: str):
    def handler(signum=None, frame=None):
        KILLED.append(f"{phase}: {signal.Signals(signum).name if signum else '?'}")

    return handler


class _TokenizerManager:
    """Like 0.5.23's: its first call binds it to the running loop and adds SIGTERM/SIGQUIT handlers to that loop."""

    def __init__(self):
        self.event_loop = None
        self.rid_to_state: dict[str, asyncio.Event] = {}  # the requests it waits on, by rid
        self.aborted: list[str] = []  # the rids abort_request ended

    def abort_request(self, rid: str = "", abort_all: bool = False):
        """Like 0.5.23's: a rid it does not know (not yet tokenized, or answered) is ignored."""
        if not abort_all and rid not in self.rid_to_state:
            return
        for r in list(self.rid_to_state) if abort_all else [rid]:
            self.aborted.append(r)
            self.rid_to_state[r].set()

    def auto_create_handle_loop(self):
        if self.event_loop is not None:
            return
        self.event_loop = loop = asyncio.get_running_loop()  # get_or_create_event_loop(), inside a coroutine
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, _kill_process_tree("sigterm_handler"), signal.SIGTERM)
            loop.add_signal_handler(signal.SIGQUIT, _kill_process_tree("running_phase_sigquit_handler"), signal.SIGQUIT)


class _FlushCacheReqOutput:
    """Like ``sglang.srt.managers.io_struct.FlushCacheReqOutput``."""

    def __init__(self, success: bool, message: str = ""):
        self.success = success
        self.message = message


class _SGLangEngine:
    """Stands in for SGLang 0.5.23's ``sglang.Engine`` (not installable without CUDA); records the calls.

    Like SGLang's, its request handling is bound to the event loop of the first request.
    """

    reply = [11, 12]
    finish = "length"
    hold_over: int | None = None  # a request for more tokens generates until it is aborted (a long turn)

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - SERVER_ARGS_FIELDS)
        if unknown:  # ServerArgs is a msgspec.Struct: TypeError on an unknown keyword
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        # _set_envs_and_config: NCCL variables and CUDA_DEVICE_MAX_CONNECTIONS into this process's environment ...
        if "NCCL_CUMEM_ENABLE" not in os.environ:
            os.environ["NCCL_CUMEM_ENABLE"] = "0"
        if "NCCL_NVLS_ENABLE" not in os.environ:
            os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
        os.environ["SGLANG_RUN_ID"] = "sglang-run-0"
        # ... and, from the main thread, a SIGQUIT handler that kills the whole process tree
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, _kill_process_tree("launch_phase_sigquit_handler"))
        self.tokenizer_manager = _TokenizerManager()
        self.loop = asyncio.new_event_loop()  # Engine.loop: where its sync methods run their coroutines
        self.handler_loop = None
        self.session: str | None = None  # the scheduler's _WeightUpdateSession
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_update: str | None = None  # SGLang's message for a failing bucket
        self.fail_end: str | None = None
        self.busy = False  # requests running: flush_cache refuses
        self.released: set[str] = set()  # the scheduler's offload_tags

    def _through_tokenizer_manager(self):
        """What each sync method does first: ``loop.run_until_complete(tokenizer_manager.<call>(...))``."""

        async def call():
            self.tokenizer_manager.auto_create_handle_loop()

        self.loop.run_until_complete(call())

    async def async_generate(self, **request):
        unknown = sorted(set(request) - ASYNC_GENERATE_KWARGS)
        if unknown:
            raise TypeError(f"async_generate() got an unexpected keyword argument {unknown[0]!r}")
        unknown = sorted(set(request.get("sampling_params") or {}) - SAMPLING_PARAMS_FIELDS)
        if unknown:
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")  # SamplingParams(**sampling_params)
        self.calls.append(("async_generate", request))
        self.tokenizer_manager.auto_create_handle_loop()
        loop = asyncio.get_running_loop()
        self.handler_loop = self.handler_loop or loop
        if loop is not self.handler_loop:
            raise RuntimeError("async_generate on another event loop than the handler's: SGLang would hang here")
        reply, finish = self.reply, self.finish
        if self.hold_over is not None and request["sampling_params"]["max_new_tokens"] > self.hold_over:
            await asyncio.sleep(0.01)  # tokenizing: the rid is not known yet
            manager = self.tokenizer_manager
            event = manager.rid_to_state[request["rid"]] = asyncio.Event()
            try:
                await event.wait()  # decoding, until abort_request
            finally:
                del manager.rid_to_state[request["rid"]]
            reply, finish = self.reply[:1], "abort"
        meta = {"id": "9f1c", "finish_reason": {"type": finish}, "prompt_tokens": len(request["input_ids"]),
                "completion_tokens": len(reply), "cached_tokens": len(request["input_ids"]) // 2}
        if request.get("return_logprob"):
            meta["output_token_logprobs"] = [(-0.5 / (i + 1), t, None) for i, t in enumerate(reply)]
        if request.get("return_routed_experts") and self.kwargs.get("enable_return_routed_experts"):
            # int32 ids by token, layer (2), top-k slot (2) of every fed token, base64 (as SGLang's meta_info)
            fed = len(request["input_ids"]) + len(self.reply) - 1
            ids = (np.arange(fed * 4, dtype=np.int32) % 8).reshape(fed, 2, 2)
            meta["routed_experts"] = base64.b64encode(ids.tobytes()).decode()
        return {"output_ids": list(reply), "meta_info": meta}  # skip_tokenizer_init: no "text"

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append(("begin_weight_update",))
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = selector
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update",))
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        if self.fail_end:
            return False, self.fail_end
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))
        if self.session is None:
            return False, NO_SESSION
        if self.fail_update:
            return False, self.fail_update
        self.weights.update(named_tensors)
        if flush_cache and self.busy:
            return False, "Weights were updated, but the cache was not flushed because requests are still running"
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache",))
        return _FlushCacheReqOutput(success=not self.busy)

    def release_memory_occupation(self, tags=None):
        self._through_tokenizer_manager()
        if self.tokenizer_manager.rid_to_state:  # the scheduler's assertion (then SIGQUIT to the trainer)
            raise AssertionError("release_memory_occupation should be called only when no ongoing request")
        self.calls.append(("release_memory_occupation", tags))
        for tag in tags or MEMORY_TYPES:
            if tag in self.released:  # the memory saver pauses a region only once
                raise RuntimeError(f"memory {tag} already released")
            self.released.add(tag)

    def resume_memory_occupation(self, tags=None):
        self._through_tokenizer_manager()
        self.calls.append(("resume_memory_occupation", tags))
        for tag in tags or MEMORY_TYPES:
            self.released.remove(tag)  # the scheduler's offload_tags.remove(tag): KeyError if not released

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture
def fake_sglang(monkeypatch):
    module = types.ModuleType("sglang")
    module.__version__ = "0.5.23"
    module.Engine = _SGLangEngine
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in CONTAINED_SIGNALS}
    environ = dict(os.environ)
    KILLED.clear()
    loops: list[asyncio.AbstractEventLoop] = []
    new_loop = asyncio.new_event_loop
    monkeypatch.setattr(asyncio, "new_event_loop", lambda: loops.append(new_loop()) or loops[-1])
    yield module
    for loop in loops:
        loop.close()
    for sig, handler in handlers.items():  # whatever the stand-in did to this test process
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(environ)


def _sync(engine: SGLangEngine, version: int, buckets: list[list[str]]) -> None:
    for names in buckets:
        engine.update_weights([(n, torch.full((1,), float(version))) for n in names], version=version)
    engine.finish_weight_update(version)


def _generate(engine: SGLangEngine, prompt: list[int], params: SamplingParams):
    """One request on the engine's loop, as the driver runs them (SGLang binds its handler to one loop)."""
    return engine.event_loop.run_until_complete(engine.generate(prompt, params))


def test_request_translation():
    params = SamplingParams(max_new_tokens=64, stop_token_ids=[151645, 151643], temperature=0.7, top_p=0.9, top_k=20, seed=7)
    sampling = {
        "max_new_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop_token_ids": [151645, 151643],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    # SGLang uses sampling_seed only with enable_deterministic_inference: sent only there
    assert to_sglang_request([1, 2, 3], params) == {"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": sampling}
    req = to_sglang_request([1, 2, 3], params, deterministic=True)
    assert req["sampling_params"] == {**sampling, "sampling_seed": 7}
    unseeded = to_sglang_sampling_params(SamplingParams(max_new_tokens=1, temperature=0.0), deterministic=True)
    assert "sampling_seed" not in unseeded and unseeded["temperature"] == 0.0 and unseeded["top_k"] == -1
    assert set(req["sampling_params"]) <= SAMPLING_PARAMS_FIELDS and set(req) <= ASYNC_GENERATE_KWARGS


def _response(finish: dict | None, triples: list, output_ids: list | None = None) -> dict:
    """An ``async_generate`` result under ``skip_tokenizer_init``: no ``text`` key."""
    out = {
        "meta_info": {
            "id": "9f1c",
            "finish_reason": finish,
            "prompt_tokens": 3,
            "weight_version": "default",
            "num_retractions": 0,
            "output_token_logprobs": triples,
            "output_token_logprobs_length": len(triples),
            "e2e_latency": 0.05,
        },
    }
    if output_ids is not None:
        out["output_ids"] = output_ids
    return out


def test_response_translation_stop_length_abort():
    triples = [(-0.25, 785, None), (-1.5, 4226, None), (-0.01, 151645, None)]
    out = from_sglang_output(_response({"type": "stop", "matched": 151645}, triples, [785, 4226, 151645]))
    assert out.token_ids == [785, 4226, 151645]
    assert out.log_probs == [-0.25, -1.5, -0.01]
    assert out.finish_reason == "stop"
    length = from_sglang_output(_response({"type": "length", "length": 2}, triples[:2], [785, 4226]))
    assert length.finish_reason == "length" and length.token_ids == [785, 4226]
    aborted = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT.to_json()
    aborted = from_sglang_output(_response(aborted, [], []))
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    assert from_sglang_output(_response(None, triples[:1])).finish_reason == "abort"


def test_response_translation_errors():
    with pytest.raises(ValueError, match="return_logprob"):
        from_sglang_output({"output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(ValueError, match="disagree"):
        from_sglang_output(_response({"type": "stop"}, [(-0.1, 5, None)], [6]))
    with pytest.raises(ValueError, match="meta_info"):
        from_sglang_output({"output_ids": [1]})


def test_engine_kwargs_are_server_args_fields():
    kw = sglang_engine_kwargs("/ckpt", tensor_model_parallel_size=2, gpu_memory_utilization=0.6, seed=3)
    assert kw["tp_size"] == 2 and kw["mem_fraction_static"] == 0.6 and kw["random_seed"] == 3
    assert kw["skip_tokenizer_init"] is True and kw["enable_memory_saver"] is True
    assert kw["enable_deterministic_inference"] is False
    assert kw["base_gpu_id"] == 0 and kw["dtype"] == "auto" and "port" not in kw
    assert set(kw) <= SERVER_ARGS_FIELDS
    kw = sglang_engine_kwargs(
        "/ckpt", tensor_model_parallel_size=2, gpu_memory_utilization=0.6, seed=None, base_gpu_id=2,
        dtype="bfloat16", port=30100, deterministic=True, extra={"log_level": "info"},
    )
    assert (kw["base_gpu_id"], kw["dtype"], kw["port"], kw["log_level"]) == (2, "bfloat16", 30100, "info")
    assert kw["enable_deterministic_inference"] is True and "random_seed" not in kw
    assert set(kw) <= SERVER_ARGS_FIELDS


def test_unknown_engine_kwarg_is_refused_like_server_args(fake_sglang):
    with pytest.raises(TypeError, match="bogus_key"):
        SGLangEngine("/ckpt", engine_kwargs={"bogus_key": 1})


def test_adapter_calls_sglang_engine_as_the_sharding_manager_needs(fake_sglang):
    engine = SGLangEngine("/ckpt", tensor_model_parallel_size=2, base_gpu_id=2, dtype="bfloat16", port=30100)
    inner = engine._engine
    assert inner.kwargs["tp_size"] == 2 and inner.kwargs["base_gpu_id"] == 2 and inner.kwargs["port"] == 30100
    assert engine.event_loop is inner.loop

    # The sharding manager resumes before the first sync, while the new engine still holds its memory:
    # that resume is a no-op (the memory saver refuses a double resume); release/resume then alternate.
    engine.resume_memory()
    engine.update_weights([("a", torch.zeros(1)), ("b", torch.zeros(1))], version=1)
    engine.update_weights([("c", torch.zeros(1))], version=1)
    engine.finish_weight_update(1)
    engine.release_memory()
    engine.release_memory()
    engine.resume_memory()
    _sync(engine, 2, [["a", "b", "c"]])
    assert engine.weight_version == 2
    assert inner.calls == [
        ("begin_weight_update",),  # the sync's first bucket opens the session ...
        ("update_weights_from_tensor", ["a", "b"], False),  # buckets never flush the cache ...
        ("update_weights_from_tensor", ["c"], False),
        ("end_weight_update",),  # ... finish closes it
        ("flush_cache",),  # ... the finished sync flushes, once
        ("release_memory_occupation", MEMORY_TYPES),
        ("resume_memory_occupation", MEMORY_TYPES),
        ("begin_weight_update",),
        ("update_weights_from_tensor", ["a", "b", "c"], False),
        ("end_weight_update",),
        ("flush_cache",),
    ]
    out = _generate(engine, [1, 2], SamplingParams(max_new_tokens=2))
    assert (out.token_ids, out.log_probs, out.finish_reason) == ([11, 12], [-0.5, -0.25], "length")
    assert inner.calls[-1][1]["input_ids"] == [1, 2] and inner.calls[-1][1]["return_logprob"] is True
    assert engine.prefix_cache_stats() == PrefixCacheStats(2, 1)  # meta_info.cached_tokens: the radix cache's hit


def test_weights_load_inside_a_weight_update_session(fake_sglang):
    """SGLang 0.5.23 loads nothing outside a begin/end_weight_update session (and says so in its result)."""
    engine = SGLangEngine("/ckpt")
    _sync(engine, 1, [["a", "b"], ["c"]])
    inner = engine._engine
    assert sorted(inner.weights) == ["a", "b", "c"] and all(float(t) == 1.0 for t in inner.weights.values())
    assert inner.session is None and engine.weight_version == 1


def test_failed_bucket_raises_closes_the_session_and_keeps_the_version(fake_sglang):
    engine = SGLangEngine("/ckpt")
    _sync(engine, 1, [["a"]])
    inner = engine._engine
    engine.update_weights([("a", torch.zeros(1))], version=2)
    inner.fail_update = "Failed to update parameter online: shape mismatch for 'b'."
    with pytest.raises(RuntimeError, match=r"update_weights_from_tensor failed during the weight sync to version 2: "
                                           r"Failed to update parameter online: shape mismatch for 'b'\."):
        engine.update_weights([("b", torch.zeros(1))], version=2)
    assert engine.weight_version == 1 and inner.session is None  # closed: the next sync can open one
    with pytest.raises(RuntimeError, match="no update_weights bucket"):
        engine.finish_weight_update(2)
    assert engine.weight_version == 1
    with pytest.raises(RuntimeError, match="before a weight sync finished"):  # partly updated weights
        _generate(engine, [1], SamplingParams(max_new_tokens=1))
    inner.fail_update = None
    _sync(engine, 2, [["a"], ["b"]])
    assert engine.weight_version == 2
    assert _generate(engine, [1], SamplingParams(max_new_tokens=1)).token_ids == [11, 12]


def test_failed_session_or_flush_keeps_the_version(fake_sglang):
    engine = SGLangEngine("/ckpt")
    inner = engine._engine
    inner.session = "all"  # someone else left a session open
    with pytest.raises(RuntimeError, match="begin_weight_update failed .*already open"):
        engine.update_weights([("a", torch.zeros(1))], version=1)
    inner.session = None
    inner.fail_end = "post-load failed"
    engine.update_weights([("a", torch.zeros(1))], version=1)
    with pytest.raises(RuntimeError, match="end_weight_update failed during the weight sync to version 1: post-load"):
        engine.finish_weight_update(1)
    assert engine.weight_version == 0
    inner.fail_end, inner.busy = None, True
    engine.update_weights([("a", torch.zeros(1))], version=1)
    with pytest.raises(RuntimeError, match="flush_cache failed"):
        engine.finish_weight_update(1)
    assert engine.weight_version == 0 and inner.session is None
    with pytest.raises(RuntimeError, match="flush_cache failed during flush_cache"):
        engine.flush_cache()


def test_an_abandoned_sync_is_closed_on_release(fake_sglang):
    """An exporter that fails midway never calls finish: release_memory ends the open session."""
    engine = SGLangEngine("/ckpt")
    engine.update_weights([("a", torch.zeros(1))], version=1)
    engine.release_memory()
    inner = engine._engine
    assert inner.session is None and engine.weight_version == 0
    engine.resume_memory()
    _sync(engine, 1, [["a"]])
    assert engine.weight_version == 1


def test_generate_after_resume_needs_a_sync(fake_sglang):
    engine = SGLangEngine("/ckpt")
    engine.release_memory()
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="sync the weights first"):
        _generate(engine, [1], SamplingParams(max_new_tokens=1))


def test_seeds_need_deterministic_inference(fake_sglang, caplog):
    plain = SGLangEngine("/ckpt")
    assert plain._engine.kwargs["enable_deterministic_inference"] is False
    with caplog.at_level(logging.WARNING, logger="mcore_agentic.rollout.engines.sglang"):
        for _ in range(2):
            _generate(plain, [1], SamplingParams(max_new_tokens=1, seed=5))
    assert "sampling_seed" not in plain._engine.calls[-1][1]["sampling_params"]
    assert sum("deterministic=True" in r.getMessage() for r in caplog.records) == 1

    det = SGLangEngine("/ckpt", deterministic=True, seed=0)
    assert det._engine.kwargs["enable_deterministic_inference"] is True and det.deterministic
    _generate(det, [1], SamplingParams(max_new_tokens=1, seed=5))
    for _ in range(2):
        _generate(det, [1], SamplingParams(max_new_tokens=1))
    seeds = [c[1]["sampling_params"]["sampling_seed"] for c in det._engine.calls]
    # unseeded requests get distinct seeds: SGLang would give them all 42, and a group's samples would be equal
    assert seeds[0] == 5 and len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    assert SGLangEngine("/ckpt", engine_kwargs={"enable_deterministic_inference": True}).deterministic


def test_memory_resumes_in_the_sharding_managers_order(fake_sglang):
    """Weights first (the sync fills them), then the KV cache with the CUDA graphs' memory; each type once."""
    engine = SGLangEngine("/ckpt")
    inner = engine._engine
    engine.resume_memory(["weights"])  # a fresh engine holds everything: nothing to resume
    engine.release_memory()
    with pytest.raises(RuntimeError, match=r"resume_memory\(\['weights'\]\) first"):
        engine.update_weights([("a", torch.zeros(1))], version=1)
    engine.resume_memory(["weights"])
    engine.resume_memory(["weights"])  # idempotent
    _sync(engine, 1, [["a"]])
    with pytest.raises(RuntimeError, match=r"memory is released \(cuda_graph, kv_cache\)"):
        _generate(engine, [1], SamplingParams(max_new_tokens=1))
    engine.resume_memory(["kv_cache"])
    assert _generate(engine, [1], SamplingParams(max_new_tokens=1)).token_ids == [11, 12]
    memory = [c for c in inner.calls if c[0].endswith("memory_occupation")]
    assert memory == [
        ("release_memory_occupation", MEMORY_TYPES),
        ("resume_memory_occupation", ["weights"]),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
    ]
    assert not inner.released
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.resume_memory(["cuda_graph"])


def test_start_up_leaves_the_trainers_signal_handlers_and_nccl_environment(fake_sglang, monkeypatch):
    """SGLang 0.5.23's SIGQUIT handler kills the process tree (torchrun forwards SIGQUIT), its tokenizer manager's
    loop handlers replace the trainer's SIGTERM (preemption) handler, and its NCCL variables would reach the
    trainer's own communicators: after the constructor, and after requests and memory calls, all are the trainer's."""
    received: list[str] = []

    def trainer_handler(signum, frame):
        received.append(signal.Signals(signum).name)

    for sig in CONTAINED_SIGNALS:
        signal.signal(sig, trainer_handler)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the trainer's own value
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's
    engine = SGLangEngine("/ckpt")
    assert all(signal.getsignal(sig) is trainer_handler for sig in CONTAINED_SIGNALS)
    assert os.environ["NCCL_NVLS_ENABLE"] == "1" and "NCCL_CUMEM_ENABLE" not in os.environ
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert os.environ["SGLANG_RUN_ID"] == "sglang-run-0"  # SGLang's own variables stay
    assert engine._engine.tokenizer_manager.event_loop is engine.event_loop  # bound to the rollout's loop

    _generate(engine, [1], SamplingParams(max_new_tokens=1))
    engine.release_memory()
    engine.resume_memory()
    assert all(signal.getsignal(sig) is trainer_handler for sig in CONTAINED_SIGNALS)
    os.kill(os.getpid(), signal.SIGQUIT)
    os.kill(os.getpid(), signal.SIGTERM)
    engine.event_loop.run_until_complete(asyncio.sleep(0.05))  # a loop still holding SGLang's handlers runs them now
    assert received == ["SIGQUIT", "SIGTERM"] and KILLED == []


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("Y", True),
     ("0", False), ("false", False), ("no", False), ("", False), (" 1", False), ("on", False), (None, False)],
)
def test_return_original_logprob_is_read_like_sglang(fake_sglang, monkeypatch, value, on):
    """get_bool_env_var takes true/1, envs' EnvBool also yes/y; neither strips; anything else is false."""
    if value is not None:
        monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", value)
    assert sglang_env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB") is on
    if on:
        with pytest.raises(RuntimeError, match="SGLANG_RETURN_ORIGINAL_LOGPROB is set"):
            SGLangEngine("/ckpt")
    else:
        SGLangEngine("/ckpt")


def test_older_sglang_without_weight_update_sessions_is_refused(fake_sglang, monkeypatch):
    class OldEngine:  # SGLang before begin/end_weight_update: updates load outside any session
        def __init__(self, **kwargs):
            raise AssertionError("the adapter must refuse before starting an engine")

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True): ...

    monkeypatch.setattr(fake_sglang, "Engine", OldEngine)
    monkeypatch.setattr(fake_sglang, "__version__", "0.5.2")
    with pytest.raises(ImportError, match=r"sglang 0\.5\.2 has no Engine\.begin_weight_update.*0\.5\.23"):
        SGLangEngine("/ckpt")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install 'mcore-agentic\[gpu\]'"):
        SGLangEngine("/nonexistent")


def test_every_rollout_runs_on_the_engines_event_loop(fake_sglang, monkeypatch):
    """SGLang's request handler lives on the loop of the first request; a fresh loop per rollout
    (``asyncio.run``) would hang the second rollout. The driver runs them all on ``engine.event_loop``."""
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer
    from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
    from mcore_agentic.rollout.driver import generate_sequences_sync

    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    monkeypatch.setattr(_SGLangEngine, "reply", [*tok.encode("4"), tok.convert_tokens_to_ids("<|im_end|>")])
    monkeypatch.setattr(_SGLangEngine, "finish", "stop")
    engine = SGLangEngine("/ckpt")
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}]}]
    cfg = RolloutConfig(n=2, multi_turn=MultiTurnConfig(enable=False))
    for _ in range(2):
        batch = generate_sequences_sync(rows, engine, None, None, cfg, tok)
        assert batch["finish_reason"] == ["stop", "stop"]
    assert engine._engine.handler_loop is engine.event_loop
    assert sum(c[0] == "async_generate" for c in engine._engine.calls) == 4


def test_build_engine_gives_sglang_the_trainers_dtype_seed_and_placement(fake_sglang):
    # The trainer builds every engine through build_engine: model.dtype, the run's seed and the
    # group's first GPU and port must reach sglang.Engine (a silent "auto" dtype would sample in the
    # checkpoint's precision while the trainer recomputes in model.dtype).
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines import SGLANG_BASE_PORT, build_engine

    cfg = RolloutConfig(name="sglang", tensor_model_parallel_size=2, seed=3)
    engine = build_engine(cfg, ModelSpec("/ckpt", "bfloat16"), device="cuda:6", seed=11)
    kwargs = engine._engine.kwargs
    assert kwargs["dtype"] == "bfloat16" and kwargs["random_seed"] == 11 and kwargs["tp_size"] == 2
    assert kwargs["base_gpu_id"] == 6 and kwargs["port"] == SGLANG_BASE_PORT + 100 * 3
    assert engine.deterministic  # rollout.seed set: reproducible samples need deterministic inference


def test_routed_experts_are_asked_for_and_decoded_per_fed_token(fake_sglang):
    """Routing replay on SGLang: ``enable_return_routed_experts`` on the server, ``return_routed_experts`` on each
    request, and ``meta_info["routed_experts"]`` (base64 int32 by token, layer, slot) decoded to one int16 row per
    fed token (prompt and samples but the last); a server that returns none is an error naming the setting."""
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines import build_engine
    from mcore_agentic.rollout.engines.sglang_io import decode_routed_experts

    path = "/ckpt/qwen3_moe"  # 2 MoE layers, top-2 (the trainer reads the shape from its config.json)
    engine = build_engine(RolloutConfig(name="sglang"), ModelSpec(path, "bfloat16", routing_shape=(2, 2)),
                          device="cuda:0", seed=1)
    assert engine._engine.kwargs["enable_return_routed_experts"] is True
    out = _generate(engine, [1, 2, 3], SamplingParams(max_new_tokens=2))
    assert engine._engine.calls[-1][1]["return_routed_experts"] is True
    assert out.routed_experts.dtype == np.int16 and out.routed_experts.shape == (3 + 2 - 1, 2, 2)
    assert out.routed_experts.reshape(-1).tolist() == [i % 8 for i in range(16)]
    plain = build_engine(RolloutConfig(name="sglang"), ModelSpec(path, "bfloat16"), device="cuda:0", seed=1)
    assert "enable_return_routed_experts" not in plain._engine.kwargs
    assert _generate(plain, [1], SamplingParams(max_new_tokens=2)).routed_experts is None
    assert "return_routed_experts" not in plain._engine.calls[-1][1]
    engine._engine.kwargs["enable_return_routed_experts"] = False  # the server would record nothing
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        _generate(engine, [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="5 tokens x 2 MoE layers"):
        decode_routed_experts(base64.b64encode(np.zeros(8, np.int32).tobytes()), routing_shape=(2, 2), tokens=5)


def test_abort_ends_requests_through_sglangs_abort_request(fake_sglang, monkeypatch):
    """``abort([rid])`` is SGLang's ``abort_request(rid)`` for that request only; one SGLang does not know yet (being
    tokenized) is aborted once it does; ``abort()`` ends every request; an id aborted before its request is issued
    is answered at once, without reaching SGLang."""
    monkeypatch.setattr(_SGLangEngine, "hold_over", 100)
    engine = SGLangEngine("/ckpt")
    manager = engine._engine.tokenizer_manager
    long = SamplingParams(max_new_tokens=1000)

    async def main():
        early = asyncio.create_task(engine.generate([1, 2], long, request_id="early"))
        await asyncio.sleep(0)  # issued, still being tokenized
        assert "early" in engine._live and "early" not in manager.rid_to_state
        engine.abort(["early"])
        cut = asyncio.create_task(engine.generate([1, 2], long, request_id="a"))
        rest = asyncio.create_task(engine.generate([1, 2], long, request_id="b"))
        while {"a", "b"} - set(manager.rid_to_state):
            await asyncio.sleep(0.001)
        engine.abort(["a"])
        results = [await early, await cut]
        assert not rest.done()
        engine.abort()
        results.append(await rest)
        calls = len(engine._engine.calls)
        engine.abort(["later"])
        results.append(await engine.generate([1, 2], long, request_id="later"))
        assert len(engine._engine.calls) == calls
        return results

    early, cut, rest, later = engine.event_loop.run_until_complete(main())
    assert [o.finish_reason for o in (early, cut, rest, later)] == ["abort"] * 4
    assert (cut.token_ids, cut.log_probs) == ([11], [-0.5]) and later.token_ids == []
    assert sorted(manager.aborted) == ["a", "b", "early"] and manager.aborted[-1] == "b"
    assert not engine._live and not manager.rid_to_state
    assert [c[1]["rid"] for c in engine._engine.calls if c[0] == "async_generate"] == ["early", "a", "b"]


def test_an_abort_answered_before_its_prefill_carries_nothing():
    """SGLang answers a request aborted in its waiting queue with no output fields at all."""
    out = from_sglang_output({"meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "Abort before "
                                                                        "prefill"}, "prompt_tokens": 0}})
    assert (out.token_ids, out.log_probs, out.finish_reason) == ([], [], "abort")
    with pytest.raises(ValueError, match="return_logprob"):
        from_sglang_output({"meta_info": {"finish_reason": {"type": "stop"}}})


def test_drain_runs_the_engines_loop_until_sglang_answered(fake_sglang, monkeypatch):
    """A request left suspended on SGLang's loop when the rollout's ``run_until_complete`` returned is live in the
    scheduler, which refuses the release (SGLang: an assertion, then SIGQUIT to the trainer). ``drain`` aborts it and
    runs the loop until SGLang has answered; the release then goes through."""
    monkeypatch.setattr(_SGLangEngine, "hold_over", 100)
    engine = SGLangEngine("/ckpt")
    loop = engine.event_loop
    left = loop.create_task(engine.generate([1, 2], SamplingParams(max_new_tokens=1000)))
    loop.run_until_complete(asyncio.sleep(0.05))  # the rollout ends with the request generating
    with pytest.raises(AssertionError, match="no ongoing request"):
        engine.release_memory()
    assert engine.drain(5.0)
    assert left.done() and left.result().finish_reason == "abort"
    engine.release_memory()
    assert engine.drain(0.0)  # nothing left: nothing to wait for


def test_an_agent_programs_request_is_aborted_before_the_rollout_ends(fake_sglang, monkeypatch):
    """GPU review C2 on SGLang: a program returns with a request generating (its session's call runs on SGLang's
    loop); the session's close aborts it and the rollout waits for SGLang's answer, so the release that follows the
    rollout finds the scheduler idle. The row is the program's one complete turn."""
    from mcore_agentic.endpoint.source import AgentSource
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer
    from mcore_agentic.rollout.config import AgentConfig, RolloutConfig
    from mcore_agentic.rollout.tokenization import ChatTokenizer

    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    monkeypatch.setattr(_SGLangEngine, "reply", [*tok.encode("Blue."), tok.convert_tokens_to_ids("<|im_end|>")])
    monkeypatch.setattr(_SGLangEngine, "finish", "stop")
    monkeypatch.setattr(_SGLangEngine, "hold_over", 100)
    engine = SGLangEngine("/ckpt")
    program = "tests.unit.endpoint.test_session_close:agent_leaves_a_turn_generating"  # 4 tokens, then 400
    cfg = RolloutConfig(prompt_length=256, response_length=768, n=1, agent=AgentConfig(entrypoint=program))
    source = AgentSource(cfg, engine, ChatTokenizer(tok), version=lambda: 1)
    try:
        batch = source.roll_out([{"prompt": [{"role": "user", "content": "Name a colour."}]}], cfg)
        engine.release_memory()  # the scheduler is idle
    finally:
        source.close()
    assert engine._engine.tokenizer_manager.aborted and not engine._live
    (metrics,) = batch["request_metrics"]
    assert metrics["state"] == "completed" and metrics["assistant_turns"] == 1 and metrics["sanity_check_mismatch"] == 0
    assert batch["messages"][0][-1] == {"role": "assistant", "content": "Blue."}
