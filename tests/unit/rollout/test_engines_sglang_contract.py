"""SGLangEngine's translation to and from sglang.Engine, without a GPU or SGLang installed.

The response dicts are shaped like ``sglang.Engine.async_generate(input_ids=..., return_logprob=True)``
results with ``skip_tokenizer_init=True``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import types

import pytest
import torch

from mcore_agentic.rollout.engines.base import SamplingParams
from mcore_agentic.rollout.engines.sglang import (
    SGLangEngine,
    from_sglang_output,
    sglang_engine_kwargs,
    to_sglang_request,
    to_sglang_sampling_params,
)


def test_request_translation():
    params = SamplingParams(max_new_tokens=64, stop_token_ids=[151645, 151643], temperature=0.7, top_p=0.9, top_k=20, seed=7)
    req = to_sglang_request([1, 2, 3], params)
    assert req == {
        "input_ids": [1, 2, 3],
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop_token_ids": [151645, 151643],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "sampling_seed": 7,
        },
    }
    unseeded = to_sglang_sampling_params(SamplingParams(max_new_tokens=1, temperature=0.0))
    assert "sampling_seed" not in unseeded and unseeded["temperature"] == 0.0 and unseeded["top_k"] == -1


def _response(finish: dict | None, triples: list, output_ids: list | None = None) -> dict:
    out = {
        "text": "",
        "meta_info": {
            "id": "9f1c",
            "finish_reason": finish,
            "prompt_tokens": 3,
            "completion_tokens": len(triples),
            "cached_tokens": 0,
            "e2e_latency": 0.05,
            "output_token_logprobs": triples,
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
    length = from_sglang_output(_response({"type": "length", "length": 2}, triples[:2]))
    assert length.finish_reason == "length" and length.token_ids == [785, 4226]
    aborted = from_sglang_output(_response({"type": "abort", "message": "memory released"}, []))
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    assert from_sglang_output(_response(None, triples[:1])).finish_reason == "abort"


def test_response_translation_errors():
    with pytest.raises(ValueError, match="return_logprob"):
        from_sglang_output({"meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(ValueError, match="disagree"):
        from_sglang_output(_response({"type": "stop"}, [(-0.1, 5, None)], [6]))
    with pytest.raises(ValueError, match="meta_info"):
        from_sglang_output({"output_ids": [1]})


def test_engine_kwargs():
    kw = sglang_engine_kwargs("/ckpt", tensor_model_parallel_size=2, gpu_memory_utilization=0.6, seed=3)
    assert kw["tp_size"] == 2 and kw["mem_fraction_static"] == 0.6 and kw["random_seed"] == 3
    assert kw["skip_tokenizer_init"] is True and kw["enable_memory_saver"] is True
    assert kw["base_gpu_id"] == 0 and kw["dtype"] == "auto" and "port" not in kw
    kw = sglang_engine_kwargs(
        "/ckpt", tensor_model_parallel_size=2, gpu_memory_utilization=0.6, seed=None, base_gpu_id=2,
        dtype="bfloat16", port=30100, extra={"log_level": "info"},
    )
    assert (kw["base_gpu_id"], kw["dtype"], kw["port"], kw["log_level"]) == (2, "bfloat16", 30100, "info")
    assert "random_seed" not in kw


class _RecordingSGLangEngine:
    """Stands in for ``sglang.Engine`` (not installable without CUDA): records the calls the adapter makes.

    Like SGLang's, its request handling is bound to the event loop of the first request.
    """

    reply = [11, 12]
    finish = "length"

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.handler_loop = None

    async def async_generate(self, **request):
        self.calls.append(("async_generate", request))
        loop = asyncio.get_running_loop()
        self.handler_loop = self.handler_loop or loop
        if loop is not self.handler_loop:
            raise RuntimeError("async_generate on another event loop than the handler's: SGLang would hang here")
        triples = [(-0.5 / (i + 1), t, None) for i, t in enumerate(self.reply)]
        return {"output_ids": list(self.reply), "meta_info": {"finish_reason": {"type": self.finish},
                                                              "output_token_logprobs": triples}}

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))

    def __getattr__(self, name):
        if name not in ("flush_cache", "release_memory_occupation", "resume_memory_occupation", "shutdown"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append((name,))


def test_adapter_calls_sglang_engine_as_the_sharding_manager_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_RecordingSGLangEngine))
    engine = SGLangEngine("/ckpt", tensor_model_parallel_size=2, base_gpu_id=2, dtype="bfloat16", port=30100)
    inner = engine._engine
    assert inner.kwargs["tp_size"] == 2 and inner.kwargs["base_gpu_id"] == 2 and inner.kwargs["port"] == 30100

    # The sharding manager resumes before the first sync, while the new engine still holds its memory:
    # that resume is a no-op (the memory saver refuses a double resume); release/resume then alternate.
    engine.resume_memory()
    engine.update_weights([("a", torch.zeros(1)), ("b", torch.zeros(1))], version=1)
    engine.update_weights([("c", torch.zeros(1))], version=1)
    engine.finish_weight_update(1)
    engine.release_memory()
    engine.release_memory()
    engine.resume_memory()
    assert engine.weight_version == 1
    assert inner.calls == [
        ("update_weights_from_tensor", ["a", "b"], False),  # buckets never flush the cache ...
        ("update_weights_from_tensor", ["c"], False),
        ("flush_cache",),  # ... the finished sync does, once
        ("release_memory_occupation",),
        ("resume_memory_occupation",),
    ]
    out = asyncio.run(engine.generate([1, 2], SamplingParams(max_new_tokens=2, seed=4)))
    assert (out.token_ids, out.log_probs, out.finish_reason) == ([11, 12], [-0.5, -0.25], "length")
    assert inner.calls[-1][1]["input_ids"] == [1, 2] and inner.calls[-1][1]["sampling_params"]["sampling_seed"] == 4


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install 'mcore-agentic\[gpu\]'"):
        SGLangEngine("/nonexistent")


def test_every_rollout_runs_on_the_engines_event_loop(monkeypatch):
    """SGLang's request handler lives on the loop of the first request; a fresh loop per rollout
    (``asyncio.run``) would hang the second rollout. The driver runs them all on ``engine.event_loop``."""
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer
    from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
    from mcore_agentic.rollout.driver import generate_sequences_sync

    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    monkeypatch.setattr(_RecordingSGLangEngine, "reply", [*tok.encode("4"), tok.convert_tokens_to_ids("<|im_end|>")])
    monkeypatch.setattr(_RecordingSGLangEngine, "finish", "stop")
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_RecordingSGLangEngine))
    engine = SGLangEngine("/ckpt")
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}]}]
    cfg = RolloutConfig(n=2, multi_turn=MultiTurnConfig(enable=False))
    for _ in range(2):
        batch = generate_sequences_sync(rows, engine, None, None, cfg, tok)
        assert batch["finish_reason"] == ["stop", "stop"]
    assert engine._engine.handler_loop is engine.event_loop
    assert sum(c[0] == "async_generate" for c in engine._engine.calls) == 4
