"""An in-process ``sglang.Engine`` behind the ``RolloutEngine`` interface (GPU only).

SGLang is imported only when :class:`SGLangEngine` is constructed, so this module
imports everywhere. The translation in both directions is kept in pure functions
(:func:`to_sglang_sampling_params`, :func:`from_sglang_output`) that the contract
test exercises without a GPU.

Logprob convention: SGLang reports the logprob of each sampled token under the
temperature-scaled distribution (before top-k/top-p) unless the environment sets
``SGLANG_RETURN_ORIGINAL_LOGPROB``, which would switch to temperature-1 logprobs; the
constructor refuses that, so both engines record the same quantity
(see :mod:`mcore_agentic.rollout.engines.base`).

The engine runs with ``skip_tokenizer_init=True``: ids in, ids out, no detokenization.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import torch

from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams

_INSTALL_HINT = "SGLangEngine needs SGLang, installed on GPU machines only: pip install 'mcore-agentic[gpu]'"


def to_sglang_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """The ``sampling_params`` dict of ``sglang.Engine.async_generate`` for ``params``."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,  # SGLang treats 0 as greedy (top_k=1)
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        # keep the stop token in the output: token-in/token-out keeps what was sampled
        "no_stop_trim": True,
    }
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def to_sglang_request(prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine.async_generate`` for one request."""
    return {
        "input_ids": list(prompt_ids),
        "sampling_params": to_sglang_sampling_params(params),
        "return_logprob": True,
    }


def from_sglang_output(output: dict[str, Any]) -> GenerationOutput:
    """A :class:`GenerationOutput` from one ``async_generate`` result dict.

    Ids and logprobs come from ``meta_info["output_token_logprobs"]`` (``(logprob, id, text)``
    triples, one per sampled token); ``output_ids``, when present, must agree.
    ``meta_info["finish_reason"]`` is ``{"type": "stop"|"length"|"abort", ...}`` (or None while
    unfinished, read as abort).
    """
    meta = output.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"SGLang output has no meta_info dict: keys {sorted(output)}")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ValueError("SGLang output has no meta_info.output_token_logprobs; call async_generate(return_logprob=True)")
    token_ids = [int(t[1]) for t in triples]
    log_probs = [float(t[0]) for t in triples]
    if "output_ids" in output and list(output["output_ids"]) != token_ids:
        raise ValueError(
            f"SGLang output_ids ({len(output['output_ids'])}) disagree with output_token_logprobs ({len(token_ids)})"
        )
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length", "abort"):
        kind = "abort"
    return GenerationOutput(token_ids=token_ids, log_probs=log_probs, finish_reason=kind)


def sglang_engine_kwargs(
    model_path: str,
    *,
    tensor_model_parallel_size: int,
    gpu_memory_utilization: float,
    seed: int | None,
    base_gpu_id: int = 0,
    dtype: str = "auto",
    port: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Constructor arguments of ``sglang.Engine`` for a colocated rollout engine.

    ``base_gpu_id``: the first GPU of the engine's rollout group (the leader's ``LOCAL_RANK``); the
    engine's TP schedulers take GPUs ``base_gpu_id .. base_gpu_id + tp - 1``. ``port``: distinct per
    engine on one node (several leaders start engines at once). ``extra`` overrides anything.
    """
    kwargs: dict[str, Any] = {
        "model_path": model_path,
        "tp_size": tensor_model_parallel_size,
        "base_gpu_id": base_gpu_id,
        "dtype": dtype,
        "mem_fraction_static": gpu_memory_utilization,
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,  # release/resume_memory_occupation around training
        "log_level": "error",
    }
    if port is not None:
        kwargs["port"] = port
    if seed is not None:
        kwargs["random_seed"] = seed
    kwargs.update(extra or {})
    return kwargs


class SGLangEngine:
    """``RolloutEngine`` over an in-process ``sglang.Engine``."""

    def __init__(
        self,
        model_path: str,
        *,
        tensor_model_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        seed: int | None = None,
        base_gpu_id: int = 0,
        dtype: str = "auto",
        port: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        try:
            import sglang
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise RuntimeError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return temperature-1 logprobs, but the rollout "
                "records temperature-scaled ones (what the trainer recomputes); unset it"
            )
        self._engine = sglang.Engine(
            **sglang_engine_kwargs(
                model_path,
                tensor_model_parallel_size=tensor_model_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                base_gpu_id=base_gpu_id,
                dtype=dtype,
                port=port,
                extra=engine_kwargs,
            )
        )
        self.weight_version = 0
        self._released = False
        # SGLang's request handler task lives on the loop of the first request; every rollout must
        # run there (the driver runs engines that have an ``event_loop`` on it, never asyncio.run).
        self.event_loop: asyncio.AbstractEventLoop = getattr(self._engine, "loop", None) or asyncio.new_event_loop()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        output = await self._engine.async_generate(**to_sglang_request(prompt_ids, params))
        return from_sglang_output(output)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        # One bucket; the prefix cache is flushed once the whole sync is in (finish_weight_update).
        self._engine.update_weights_from_tensor(named_tensors=list(named_tensors), flush_cache=False)

    def finish_weight_update(self, version: int) -> None:
        self._engine.flush_cache()
        self.weight_version = version

    # Idempotent, like HFEngine's: the sharding manager resumes before the first sync, when
    # the freshly built engine still holds its memory (the memory saver refuses a double resume).
    def release_memory(self) -> None:
        if not self._released:
            self._engine.release_memory_occupation()
            self._released = True

    def resume_memory(self) -> None:
        if self._released:
            self._engine.resume_memory_occupation()
            self._released = False

    def flush_cache(self) -> None:
        self._engine.flush_cache()

    def shutdown(self) -> None:
        self._engine.shutdown()
