"""An in-process ``sglang.Engine`` (SGLang 0.5.23) behind the ``RolloutEngine`` interface (GPU only).

SGLang is imported only when :class:`SGLangEngine` is constructed, so this module
imports everywhere. The translation in both directions is kept in pure functions
(:func:`to_sglang_sampling_params`, :func:`from_sglang_output`) that the contract
test exercises without a GPU.

Logprob convention: SGLang reports the logprob of each sampled token under the
temperature-scaled distribution (before top-k/top-p) unless the environment sets
``SGLANG_RETURN_ORIGINAL_LOGPROB``, which would switch to temperature-1 logprobs; the
constructor refuses that, so both engines record the same quantity
(see :mod:`mcore_agentic.rollout.engines.base`).

Seeds: SGLang uses a request's ``sampling_seed`` only when the engine runs with
``enable_deterministic_inference`` (batch-invariant kernels, pytorch sampling; slower).
``SGLangEngine(deterministic=True)`` turns that on and passes ``SamplingParams.seed``, so the
same seed, prompt and weights give the same completion; an unseeded request then gets a fresh
random seed (SGLang would give every unseeded request seed 42, making a group's samples equal).
With ``deterministic=False`` (the default) seeds have no effect and are not sent; the first
seeded request logs a warning.

Weight sync: every ``update_weights_from_tensor`` runs inside one SGLang weight-update session
(``begin_weight_update`` at a sync's first bucket, ``end_weight_update`` in
:meth:`SGLangEngine.finish_weight_update`). Every call's result is checked; a failure raises
``RuntimeError`` naming the call and SGLang's message, closes the session and leaves
``weight_version`` unchanged (the weights may be partly updated: sync again before generating).

The engine runs with ``skip_tokenizer_init=True``: ids in, ids out, no detokenization.

Routed experts (``routing_shape=(moe_layers, top_k)``, routing replay): the engine starts with
``enable_return_routed_experts`` and each request asks for ``return_routed_experts``; SGLang returns
``meta_info["routed_experts"]``, base64 of int32 ids ordered by token, layer and top-k slot, one row per token
it fed (prompt and samples but the last). SGLang's radix cache keeps a cached prefix's rows from the
request that computed them, which is what the trajectory keeps too.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)

_INSTALL_HINT = "SGLangEngine needs SGLang, installed on GPU machines only: pip install 'mcore-agentic[gpu]'"
_SEED_BITS = 62  # SGLang accepts any int64 sampling_seed


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
    unfinished, read as abort). With ``routing_shape`` (``(moe_layers, top_k)``), ``meta_info["routed_experts"]``
    becomes ``routed_experts`` for the ``prompt_len`` prompt tokens and the samples but the last.
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
    routed = None
    if routing_shape is not None:
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


def _check(call: str, result: Any, *, during: str, then: str, none_ok: bool = False) -> None:
    """Raise ``RuntimeError`` if ``result`` of ``sglang.Engine.<call>`` reports a failure.

    SGLang 0.5.23 returns ``(success, message)`` from begin/end_weight_update and
    update_weights_from_tensor, a ``FlushCacheReqOutput`` (``.success``, ``.message``) from
    flush_cache and None from release/resume_memory_occupation (``none_ok``). The error reads
    "sglang.Engine.<call> failed during <during>: <SGLang's message>; <then>".
    """
    if result is None and none_ok:
        return
    if isinstance(result, tuple) and len(result) == 2:
        success, message = result
    elif hasattr(result, "success"):
        success, message = result.success, getattr(result, "message", "")
    else:
        raise RuntimeError(f"sglang.Engine.{call} returned {result!r}, no success flag: SGLangEngine targets 0.5.23")
    if not success:
        raise RuntimeError(f"sglang.Engine.{call} failed during {during}: {message or 'no message'}; {then}")


class SGLangEngine:
    """``RolloutEngine`` over an in-process ``sglang.Engine`` (SGLang 0.5.23)."""

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
        deterministic: bool = False,
        engine_kwargs: dict[str, Any] | None = None,
        routing_shape: tuple[int, int] | None = None,
    ):
        try:
            import sglang
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        if sglang_env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB"):
            raise RuntimeError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return temperature-1 logprobs, but the rollout "
                "records temperature-scaled ones (what the trainer recomputes); unset it"
            )
        if not hasattr(sglang.Engine, "begin_weight_update"):
            raise ImportError(
                f"sglang {getattr(sglang, '__version__', '?')} has no Engine.begin_weight_update: "
                "SGLangEngine targets SGLang 0.5.23; pip install 'sglang[srt]==0.5.23'"
            )
        kwargs = sglang_engine_kwargs(
            model_path,
            tensor_model_parallel_size=tensor_model_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            base_gpu_id=base_gpu_id,
            dtype=dtype,
            port=port,
            deterministic=deterministic,
            extra={**({"enable_return_routed_experts": True} if routing_shape else {}), **(engine_kwargs or {})},
        )
        self.routing_shape = routing_shape
        """``(moe_layers, top_k)``: every request returns its routed experts (routing replay); None: none."""
        self.deterministic = bool(kwargs.get("enable_deterministic_inference"))
        """Whether ``SamplingParams.seed`` takes effect (SGLang's ``enable_deterministic_inference``)."""
        self._engine = sglang.Engine(**kwargs)
        self.weight_version = 0
        self._released = False
        self._session_open = False  # an SGLang weight-update session is open: a sync is under way
        self._weights_valid = True  # False from resume_memory() or a sync's first bucket until a sync finishes
        self._seed_rng = random.Random(seed)
        self._warned_seed = False
        # SGLang's request handler task lives on the loop of the first request; every rollout must
        # run there (the driver runs engines that have an ``event_loop`` on it, never asyncio.run).
        self.event_loop: asyncio.AbstractEventLoop = getattr(self._engine, "loop", None) or asyncio.new_event_loop()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if not self._weights_valid:
            raise RuntimeError(
                "SGLangEngine.generate before a weight sync finished (after resume_memory() or a failed sync); "
                "sync the weights first"
            )
        if self.deterministic and params.seed is None:
            # SGLang would seed every unseeded request with 42: a group's samples would all be equal
            params = replace(params, seed=self._seed_rng.getrandbits(_SEED_BITS))
        elif params.seed is not None and not self.deterministic and not self._warned_seed:
            self._warned_seed = True
            logger.warning(
                "SamplingParams.seed has no effect on SGLangEngine(deterministic=False): SGLang uses sampling_seed "
                "only with enable_deterministic_inference; pass deterministic=True for reproducible samples"
            )
        request = to_sglang_request(prompt_ids, params, deterministic=self.deterministic,
                                    return_routed_experts=self.routing_shape is not None)
        output = await self._engine.async_generate(**request)
        return from_sglang_output(output, prompt_len=len(prompt_ids), routing_shape=self.routing_shape)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load one bucket; a sync's first bucket opens SGLang's weight-update session."""
        tensors = list(named_tensors)
        during = f"the weight sync to version {version}"
        if not self._session_open:
            self._weights_valid = False
            _check("begin_weight_update", self._engine.begin_weight_update(), during=during, then="nothing was loaded")
            self._session_open = True
        try:
            # One bucket; the prefix cache is flushed once the whole sync is in (finish_weight_update).
            result = self._engine.update_weights_from_tensor(named_tensors=tensors, flush_cache=False)
            _check("update_weights_from_tensor", result, during=during, then="weights partly updated: sync again")
        except BaseException:
            self._close_session()
            raise

    def finish_weight_update(self, version: int) -> None:
        """Close the weight-update session and flush the prefix cache; only then report ``version``."""
        if not self._session_open:
            raise RuntimeError(
                f"SGLangEngine.finish_weight_update({version}) with no update_weights bucket since the last sync: "
                "send the weights first"
            )
        self._session_open = False
        during = f"the weight sync to version {version}"
        _check("end_weight_update", self._engine.end_weight_update(), during=during, then="sync again")
        _check("flush_cache", self._engine.flush_cache(), during=during, then="wait for running requests, sync again")
        self.weight_version = version
        self._weights_valid = True

    def _close_session(self) -> None:
        """End the open weight-update session of a failed or abandoned sync (SGLang has no abort)."""
        if not self._session_open:
            return
        self._session_open = False
        try:
            result = self._engine.end_weight_update()
            _check("end_weight_update", result, during="closing a failed sync's session", then="restart the engine")
        except Exception as exc:  # the sync's own error is the one raised
            logger.warning("%s", exc)

    # Idempotent, like HFEngine's: the sharding manager resumes before the first sync, when
    # the freshly built engine still holds its memory (the memory saver refuses a double resume).
    def release_memory(self) -> None:
        self._close_session()  # a sync whose export failed midway leaves its session open
        if not self._released:
            result = self._engine.release_memory_occupation()
            _check("release_memory_occupation", result, during="release_memory", then="stop the rollout", none_ok=True)
            self._released = True

    def resume_memory(self) -> None:
        if self._released:
            result = self._engine.resume_memory_occupation()
            _check("resume_memory_occupation", result, during="resume_memory", then="restart the engine", none_ok=True)
            self._released = False
            # without enable_weights_cpu_backup the memory saver keeps no copy: the weights must be synced
            self._weights_valid = False

    def flush_cache(self) -> None:
        _check("flush_cache", self._engine.flush_cache(), during="flush_cache", then="wait for running requests")

    def shutdown(self) -> None:
        self._engine.shutdown()
