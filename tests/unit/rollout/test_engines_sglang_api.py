"""SGLangEngine's arguments checked with SGLang's own classes (skipped where SGLang is not installed).

The adapter targets SGLang 0.5.23. These need ``sglang`` importable with its Python dependencies
(msgspec, torch, transformers, ...), not a GPU: ``ServerArgs`` is built without resolving it,
``SamplingParams`` is built, normalized without a tokenizer (``skip_tokenizer_init``) and verified.
"""

from __future__ import annotations

import importlib
import inspect
import re
from types import ModuleType

import pytest

from mcore_agentic.rollout.engines.base import SamplingParams
from mcore_agentic.rollout.engines.sglang import SGLANG_MEMORY_TAGS
from mcore_agentic.rollout.engines.sglang_io import sglang_engine_kwargs, sglang_env_flag, to_sglang_request
from mcore_agentic.rollout.engines.sglang_process import _contained_env_key

pytest.importorskip("sglang")


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # a missing optional dependency of SGLang's, on a machine without CUDA
        pytest.skip(f"{name} does not import here: {type(exc).__name__}: {exc}")


def test_engine_kwargs_build_server_args():
    server_args = _module("sglang.srt.server_args")
    for kwargs in (
        sglang_engine_kwargs("/ckpt", tensor_model_parallel_size=1, gpu_memory_utilization=0.5, seed=None),
        sglang_engine_kwargs(
            "/ckpt", tensor_model_parallel_size=2, gpu_memory_utilization=0.6, seed=3, base_gpu_id=2,
            dtype="bfloat16", port=30100, deterministic=True,
        ),
    ):
        args = server_args.ServerArgs(**kwargs)  # a msgspec.Struct: TypeError on a key that is no field
        for key, value in kwargs.items():
            assert getattr(args, key) == value, key


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=64, stop_token_ids=[151645, 151643], temperature=0.7, top_p=0.9, top_k=20, seed=7),
        SamplingParams(max_new_tokens=1, temperature=0.0),
        SamplingParams(max_new_tokens=8, seed=-(2**62)),
    ],
)
@pytest.mark.parametrize("deterministic", [False, True])
def test_sampling_params_build_and_verify(params, deterministic):
    sampling = _module("sglang.srt.sampling.sampling_params")
    request = to_sglang_request([1, 2, 3], params, deterministic=deterministic)
    sp = sampling.SamplingParams(**request["sampling_params"])
    sp.normalize(None)  # skip_tokenizer_init: no tokenizer
    sp.verify(vocab_size=151936)
    assert sp.max_new_tokens == params.max_new_tokens and sp.no_stop_trim is True
    assert sp.stop_token_ids == (set(params.stop_token_ids) or None)
    if params.temperature == 0:
        assert sp.top_k == 1  # SGLang's greedy
    assert sp.sampling_seed == (params.seed if deterministic else None)


def test_generate_request_fields():
    io_struct = _module("sglang.srt.managers.io_struct")
    request = to_sglang_request([1, 2, 3], SamplingParams(max_new_tokens=4, seed=1), deterministic=True)
    obj = io_struct.GenerateReqInput(**request)
    assert obj.input_ids == [1, 2, 3] and obj.return_logprob is True


def test_engine_methods_the_adapter_calls():
    engine = _module("sglang.srt.entrypoints.engine").Engine
    params = {name: set(inspect.signature(getattr(engine, name)).parameters) for name in (
        "async_generate", "begin_weight_update", "end_weight_update", "update_weights_from_tensor",
        "flush_cache", "release_memory_occupation", "resume_memory_occupation", "shutdown",
    )}
    assert {"input_ids", "sampling_params", "return_logprob"} <= params["async_generate"]
    assert {"named_tensors", "flush_cache"} <= params["update_weights_from_tensor"]
    assert "tags" in params["release_memory_occupation"] and "tags" in params["resume_memory_occupation"]
    assert list(_module("sglang.srt.constants").GPU_MEMORY_ALL_TYPES) == list(SGLANG_MEMORY_TAGS)
    # the constructor binds the tokenizer manager's loop itself, to take back the signal handlers it adds
    manager = _module("sglang.srt.managers.tokenizer_manager").TokenizerManager
    assert "add_signal_handler" in inspect.getsource(manager.auto_create_handle_loop)
    # abort: the tokenizer manager's abort_request by rid, sent once the rid is among the requests it waits on
    assert {"rid", "abort_all"} <= set(inspect.signature(manager.abort_request).parameters)
    assert "self.rid_to_state" in inspect.getsource(manager)


def test_start_up_environment_writes_are_known():
    """Every variable SGLang's start-up writes is either put back by the adapter (NCCL's, Megatron's) or SGLang's own."""
    source = inspect.getsource(_module("sglang.srt.entrypoints.engine")._set_envs_and_config)
    written = set(re.findall(r"os\.environ\[\s*[\"'](\w+)[\"']\s*\]\s*=", source))
    written |= set(re.findall(r"os\.environ\.setdefault\(\s*[\"'](\w+)[\"']", source))
    own = {"SGLANG_RUN_ID", "TRTLLM_ENABLE_PDL", "CUTE_DSL_LOG_LEVEL", "CUTE_DSL_LOG_TO_CONSOLE"}
    assert "NCCL_CUMEM_ENABLE" in written and "CUDA_DEVICE_MAX_CONNECTIONS" in written
    assert {k for k in written if not _contained_env_key(k)} <= own


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "Y", "y", "0", "false", "no", "", " 1", "on", "2"])
def test_env_flag_reads_like_sglang(monkeypatch, value):
    common = _module("sglang.srt.utils.common")
    environ = _module("sglang.srt.environ")
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", value)
    theirs = common.get_bool_env_var("SGLANG_RETURN_ORIGINAL_LOGPROB") or environ.envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get()
    assert sglang_env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB") is bool(theirs)


def test_the_contract_tests_stand_in_accepts_only_real_names():
    """The stand-in in test_engines_sglang_contract.py rejects keys outside these lists: they must be real."""
    import msgspec

    from tests.unit.rollout import test_engines_sglang_contract as contract

    server_args = _module("sglang.srt.server_args").ServerArgs
    sampling = _module("sglang.srt.sampling.sampling_params").SamplingParams
    assert contract.SERVER_ARGS_FIELDS <= {f.name for f in msgspec.structs.fields(server_args)}
    assert contract.SAMPLING_PARAMS_FIELDS <= {f.name for f in msgspec.structs.fields(sampling)}
    engine = _module("sglang.srt.entrypoints.engine").Engine
    assert contract.ASYNC_GENERATE_KWARGS <= set(inspect.signature(engine.async_generate).parameters)
