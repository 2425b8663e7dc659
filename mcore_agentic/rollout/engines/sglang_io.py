"""The SGLang adapter's translation in both directions (:mod:`~mcore_agentic.rollout.engines.sglang`), pure
functions the contract test exercises without a GPU: engine and request arguments for ``sglang.Engine``, its
outputs (ids, logprobs, finish reason, routed experts) as :class:`GenerationOutput`, and its environment flags."""

from __future__ import annotations

import base64
import os
from typing import Any

import numpy as np
import torch

from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams, aborted_output


def sglang_env_flag(name: str) -> bool:
    """Whether SGLang 0.5.23 reads the boolean environment variable ``name`` as set.

    SGLang has two readers: ``get_bool_env_var`` (``srt/layers/sampler.py``; "true"/"1") and
    ``envs.<name>.get()`` (``EnvBool``, ``srt/layers/logprob_processor.py``; also "yes"/"y").
    Both lower-case the raw value without stripping it and read anything else as false; this
    is True when either of them would switch on.
    """
    value = os.environ.get(name)
    return value is not None and value.lower() in ("true", "1", "yes", "y")


def to_sglang_sampling_params(params: SamplingParams, *, deterministic: bool = False) -> dict[str, Any]:
    """The ``sampling_params`` dict of ``sglang.Engine.async_generate`` for ``params``.

    ``sampling_seed`` is sent only on a ``deterministic`` engine (elsewhere SGLang ignores it).
    """
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,  # SGLang treats 0 as greedy (top_k=1)
        "top_p": params.top_p,
        "top_k": params.top_k,  # -1: whole vocabulary
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        # keep the stop token in the output: token-in/token-out keeps what was sampled
        "no_stop_trim": True,
    }
    if deterministic and params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def to_sglang_request(
    prompt_ids: list[int], params: SamplingParams, *, deterministic: bool = False, return_routed_experts: bool = False
) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine.async_generate`` for one request."""
    request = {
        "input_ids": list(prompt_ids),
        "sampling_params": to_sglang_sampling_params(params, deterministic=deterministic),
        "return_logprob": True,
    }
    if return_routed_experts:
        request["return_routed_experts"] = True
    return request


def decode_routed_experts(value: Any, *, routing_shape: tuple[int, int], tokens: int) -> np.ndarray:
    """``meta_info["routed_experts"]`` (base64 of int32, or an array) as ``[tokens, moe_layers, top_k]`` int16."""
    if isinstance(value, (str, bytes)):
        flat = np.frombuffer(base64.b64decode(value), dtype=np.int32)
    else:
        flat = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value, dtype=np.int32).reshape(-1)
    per_token = routing_shape[0] * routing_shape[1]
    if flat.size % per_token or flat.size // per_token < tokens:
        raise ValueError(
            f"SGLang returned {flat.size} routed expert ids, not {tokens} tokens x {routing_shape[0]} MoE layers x "
            f"top-{routing_shape[1]}: does the server run with enable_return_routed_experts on this model?"
        )
    return flat.reshape(-1, *routing_shape)[:tokens].astype(np.int16)


def from_sglang_output(
    output: dict[str, Any], *, prompt_len: int = 0, routing_shape: tuple[int, int] | None = None
) -> GenerationOutput:
    """A :class:`GenerationOutput` from one ``async_generate`` result dict.

    With ``skip_tokenizer_init`` the result is ``{"output_ids", "meta_info"}`` (no ``text``).
    Ids and logprobs come from ``meta_info["output_token_logprobs"]`` (``(logprob, id, None)``
    triples, one per sampled token); ``output_ids``, when present, must agree.
    ``meta_info["finish_reason"]`` is ``{"type": "stop"|"length"|"abort", ...}`` (or None while
    unfinished, read as abort; an abort before the prefill carries no output fields: nothing sampled). With
    ``routing_shape`` (``(moe_layers, top_k)``), ``meta_info["routed_experts"]``
    becomes ``routed_experts`` for the ``prompt_len`` prompt tokens and the samples but the last.
    """
    meta = output.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"SGLang output has no meta_info dict: keys {sorted(output)}")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    triples = meta.get("output_token_logprobs")
    if triples is None:
        if kind == "abort":  # aborted before its prefill: SGLang answers without any output field
            return aborted_output()
        raise ValueError("SGLang output has no meta_info.output_token_logprobs; call async_generate(return_logprob=True)")
    token_ids = [int(t[1]) for t in triples]
    log_probs = [float(t[0]) for t in triples]
    if "output_ids" in output and list(output["output_ids"]) != token_ids:
        raise ValueError(
            f"SGLang output_ids ({len(output['output_ids'])}) disagree with output_token_logprobs ({len(token_ids)})"
        )
    if kind not in ("stop", "length", "abort"):
        kind = "abort"
    routed = None
    if routing_shape is not None and not (kind == "abort" and meta.get("routed_experts") is None):
        if meta.get("routed_experts") is None:
            raise ValueError("SGLang output has no meta_info.routed_experts; start the engine with "
                             "enable_return_routed_experts and call async_generate(return_routed_experts=True)")
        fed = prompt_len + max(len(token_ids) - 1, 0)
        routed = decode_routed_experts(meta["routed_experts"], routing_shape=routing_shape, tokens=fed)
    return GenerationOutput(token_ids=token_ids, log_probs=log_probs, finish_reason=kind, routed_experts=routed)


def sglang_engine_kwargs(
    model_path: str,
    *,
    tensor_model_parallel_size: int,
    gpu_memory_utilization: float,
    seed: int | None,
    base_gpu_id: int = 0,
    dtype: str = "auto",
    port: int | None = None,
    deterministic: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Constructor arguments of ``sglang.Engine`` (fields of SGLang 0.5.23's ``ServerArgs``).

    ``base_gpu_id``: the first GPU of the engine's rollout group (the leader's ``LOCAL_RANK``); the
    engine's TP schedulers take GPUs ``base_gpu_id .. base_gpu_id + tp - 1``. ``port``: SGLang's HTTP
    port; the in-process engine binds nothing on it on one node (its processes talk over ``ipc://``
    files and NCCL's store takes ``nccl_port``, a random free port in 22000-29999 unless ``extra``
    sets one); with DP attention SGLang derives ZMQ ports from it. ``deterministic``:
    ``enable_deterministic_inference`` (needed for per-request seeds). ``extra`` overrides anything.
    """
    kwargs: dict[str, Any] = {
        "model_path": model_path,
        "tp_size": tensor_model_parallel_size,
        "base_gpu_id": base_gpu_id,
        "dtype": dtype,
        "mem_fraction_static": gpu_memory_utilization,
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,  # release/resume_memory_occupation around training
        "enable_deterministic_inference": deterministic,
        "log_level": "error",
    }
    if port is not None:
        kwargs["port"] = port
    if seed is not None:
        kwargs["random_seed"] = seed
    kwargs.update(extra or {})
    return kwargs


__all__ = [
    "decode_routed_experts",
    "from_sglang_output",
    "sglang_engine_kwargs",
    "sglang_env_flag",
    "to_sglang_request",
    "to_sglang_sampling_params",
]
