"""SGLangEngine's translation to and from sglang.Engine, without a GPU or SGLang installed.

The response dicts are shaped like ``sglang.Engine.async_generate(input_ids=..., return_logprob=True)``
results with ``skip_tokenizer_init=True``.
"""

from __future__ import annotations

import importlib.util

import pytest

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


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install 'mcore-agentic\[gpu\]'"):
        SGLangEngine("/nonexistent")
