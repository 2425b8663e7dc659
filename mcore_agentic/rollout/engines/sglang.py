"""An in-process ``sglang.Engine`` (SGLang 0.5.23) behind the ``RolloutEngine`` interface (GPU only).

SGLang is imported only when :class:`SGLangEngine` is constructed, so this module
imports everywhere. The translation in both directions is kept in pure functions
(:func:`to_sglang_sampling_params`, :func:`from_sglang_output`; :mod:`~mcore_agentic.rollout.engines.sglang_io`)
that the contract test exercises without a GPU; what SGLang's start-up changes in this process and the adapter puts
back is :class:`ProcessState` (:mod:`~mcore_agentic.rollout.engines.sglang_process`).

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

Memory: ``release_memory`` releases every memory type SGLang 0.5.23 has (``kv_cache``, ``weights``,
``cuda_graph``); ``resume_memory(["weights"])`` resumes the weights (the sync refills them: no CPU backup),
``resume_memory(["kv_cache"])`` the KV cache and the CUDA graphs' memory, which only generation needs.

Abort (:meth:`SGLangEngine.abort`): every request carries its ``rid``; an aborted one gets SGLang's
``TokenizerManager.abort_request(rid)`` (once the tokenizer manager knows the rid: a request still being tokenized
is aborted a moment later), sent on the engine's event loop, whose scheduler then ends it with finish ``abort``.
The caller's coroutine returns when SGLang answers, which needs that loop to run: :meth:`SGLangEngine.drain` runs it
(as the engine's own sync calls do) until every request has returned.

Process state: SGLang's start-up (``_set_envs_and_config``) installs a SIGQUIT handler that kills this
process's whole tree (torchrun forwards SIGQUIT to the trainer), writes ``NCCL_CUMEM_ENABLE``,
``NCCL_NVLS_ENABLE`` (and ``NCCL_GRAPH_MIXING_SUPPORT``) and ``CUDA_DEVICE_MAX_CONNECTIONS=8`` into this
process's environment, which the trainer's own NCCL communicators and Megatron would read; and its
tokenizer manager, at the first call, adds SIGTERM and SIGQUIT handlers to its event loop (replacing the
trainer's preemption handler). The adapter starts that first call itself inside the constructor and, once
the engine is up, removes the loop's handlers and puts back the trainer's SIGQUIT/SIGTERM handlers and
those environment variables (:class:`ProcessState`). SGLang's children were started with its values. Left
as SGLang sets them: its own variables (``SGLANG_*``, ``CUTE_DSL_*``, ``TRTLLM_ENABLE_PDL``), the open-files
limit and multiprocessing's ``spawn`` start method.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from mcore_agentic.rollout.engines.base import (
    AbortBook,
    GenerationOutput,
    PrefixCacheStats,
    SamplingParams,
    aborted_output,
    memory_tags,
)
from mcore_agentic.rollout.engines.sglang_io import (
    from_sglang_output,
    sglang_engine_kwargs,
    sglang_env_flag,
    to_sglang_request,
)
from mcore_agentic.rollout.engines.sglang_process import ProcessState

logger = logging.getLogger(__name__)

_INSTALL_HINT = "SGLangEngine needs SGLang, installed on GPU machines only: pip install 'mcore-agentic[gpu]'"
_SEED_BITS = 62  # SGLang accepts any int64 sampling_seed

SGLANG_MEMORY_TAGS: tuple[str, ...] = ("kv_cache", "weights", "cuda_graph")
"""SGLang 0.5.23's memory types (``srt/constants.py::GPU_MEMORY_ALL_TYPES``)."""
_WAKES = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
"""SGLang's memory types each of our ``resume_memory`` tags wakes."""

def _start_handle_loop(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Make SGLang's tokenizer manager bind its request handling to ``loop`` now (0.5.23 does it at the first
    request, ``auto_create_handle_loop``, and adds its SIGTERM/SIGQUIT handlers to the loop then), so that the
    constructor can take those handlers back; a version without that method binds at its first request."""
    start = getattr(getattr(engine, "tokenizer_manager", None), "auto_create_handle_loop", None)
    if start is None:
        logger.warning("sglang.Engine has no tokenizer_manager.auto_create_handle_loop: its first request may "
                       "install SIGTERM/SIGQUIT handlers that replace the trainer's (SGLangEngine targets 0.5.23)")
        return

    async def bind() -> None:
        start()

    loop.run_until_complete(bind())


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
        trainer_state = ProcessState.capture()
        loop: asyncio.AbstractEventLoop | None = None
        try:
            self._engine = sglang.Engine(**kwargs)
            loop = getattr(self._engine, "loop", None)
            if loop is not None:
                _start_handle_loop(self._engine, loop)
        finally:
            changed = trainer_state.restore(loop)
            if changed:
                logger.info("SGLang's start-up changed %s in the trainer's process: put back", ", ".join(changed))
        self.weight_version = 0
        self._released: set[str] = set()  # SGLang's memory types released and not resumed yet
        self._session_open = False  # an SGLang weight-update session is open: a sync is under way
        self._weights_valid = True  # False from resume_memory() or a sync's first bucket until a sync finishes
        self._seed_rng = random.Random(seed)
        self._warned_seed = False
        self._prompt_tokens = 0  # prefix_cache_stats
        self._cached_tokens = 0
        self._aborts = AbortBook()
        self._live: dict[str, int] = {}  # rid -> AbortBook.epoch, of every request SGLang has not answered yet
        self._aborted: set[str] = set()  # rids whose abort_request was sent
        # SGLang's request handler task lives on the loop of the first request; every rollout must
        # run there (the driver runs engines that have an ``event_loop`` on it, never asyncio.run).
        self.event_loop: asyncio.AbstractEventLoop = getattr(self._engine, "loop", None) or asyncio.new_event_loop()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        if self._released:
            raise RuntimeError(
                f"SGLangEngine.generate while memory is released ({', '.join(sorted(self._released))}); call "
                "resume_memory() and sync the weights first"
            )
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
        if self._aborts.hit(request_id):  # aborted before it was issued
            return aborted_output()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        request = to_sglang_request(prompt_ids, params, deterministic=self.deterministic,
                                    return_routed_experts=self.routing_shape is not None)
        self._live[rid] = self._aborts.epoch
        try:
            output = await self._engine.async_generate(**request, rid=rid)
        except Exception:
            if rid in self._aborted:  # a version that raises for an aborted request
                return aborted_output()
            raise
        finally:
            self._live.pop(rid, None)
            self._aborted.discard(rid)
        meta = output.get("meta_info") if isinstance(output, dict) else None
        self._prompt_tokens += len(prompt_ids)
        self._cached_tokens += int((meta or {}).get("cached_tokens") or 0)  # its radix cache's prefix hit
        return from_sglang_output(output, prompt_len=len(prompt_ids), routing_shape=self.routing_shape)

    def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the requests ``request_ids`` names (None: every request issued so far): SGLang's ``abort_request``
        for each, sent on the engine's loop (from another thread: scheduled there). Returns at once."""
        self._aborts.abort(request_ids)
        loop = self.event_loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or not loop.is_running():
            self._send_aborts()
        else:
            loop.call_soon_threadsafe(self._send_aborts)

    def _send_aborts(self) -> None:
        for rid, epoch in list(self._live.items()):
            if rid not in self._aborted and self._aborts.hit(rid, epoch):
                self._aborted.add(rid)
                self._abort_rid(rid)

    def _abort_rid(self, rid: str) -> None:
        """``abort_request(rid)`` once SGLang's tokenizer manager holds the request (it ignores an unknown rid)."""
        if rid not in self._live:
            return
        manager = self._engine.tokenizer_manager
        known = getattr(manager, "rid_to_state", None)
        if known is not None and rid not in known:  # still being tokenized: try again on the loop's next turns
            self.event_loop.call_later(0.005, self._abort_rid, rid)
            return
        manager.abort_request(rid=rid)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Abort every request and run the engine's loop (at most ``timeout_s``) until SGLang has answered each;
        whether it has. Not from a coroutine on that loop (it cannot run the loop it is inside)."""
        self.abort()
        loop = self.event_loop
        deadline = time.monotonic() + timeout_s
        if not loop.is_running():

            async def answered() -> None:
                while self._live and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)

            loop.run_until_complete(answered())
        else:
            try:
                inside = asyncio.get_running_loop() is loop
            except RuntimeError:
                inside = False
            if inside:
                raise RuntimeError("SGLangEngine.drain from a coroutine on the engine's own loop: await the requests")
            while self._live and time.monotonic() < deadline:
                time.sleep(0.005)
        return not self._live

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens of the requests it returned, and those SGLang's radix cache served
        (``meta_info.cached_tokens``)."""
        return PrefixCacheStats(self._prompt_tokens, self._cached_tokens)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load one bucket; a sync's first bucket opens SGLang's weight-update session."""
        if "weights" in self._released:
            raise RuntimeError(
                "SGLangEngine.update_weights while its weights are released; call resume_memory(['weights']) first"
            )
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

    # Idempotent per memory type, like HFEngine's: the memory saver refuses to pause or resume a type twice.
    def release_memory(self) -> None:
        """Release every memory type still held (SGLang's ``release_memory_occupation``)."""
        self._close_session()  # a sync whose export failed midway leaves its session open
        held = [t for t in SGLANG_MEMORY_TAGS if t not in self._released]
        if held:
            result = self._engine.release_memory_occupation(tags=held)
            _check("release_memory_occupation", result, during="release_memory", then="stop the rollout", none_ok=True)
            self._released.update(held)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Resume what ``tags`` names (None: all): ``weights``, or ``kv_cache`` (with the CUDA graphs' memory)."""
        wanted = {t for tag in memory_tags(tags) for t in _WAKES[tag]}
        wake = [t for t in SGLANG_MEMORY_TAGS if t in wanted and t in self._released]
        if not wake:
            return
        result = self._engine.resume_memory_occupation(tags=wake)
        _check("resume_memory_occupation", result, during="resume_memory", then="restart the engine", none_ok=True)
        self._released.difference_update(wake)
        if "weights" in wake:
            # without enable_weights_cpu_backup the memory saver keeps no copy: the weights must be synced
            self._weights_valid = False

    def flush_cache(self) -> None:
        _check("flush_cache", self._engine.flush_cache(), during="flush_cache", then="wait for running requests")

    def shutdown(self) -> None:
        self._engine.shutdown()


__all__ = [
    "SGLANG_MEMORY_TAGS",
    "SGLangEngine",
]
