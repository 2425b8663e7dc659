"""The one async interface every rollout engine implements, and its request/response types.

Token-in, token-out: an engine takes prompt ids and returns the ids it sampled (the
stop token included when it stopped on one) with the logprob of each.

Which distribution the logprobs refer to: ``log softmax(logits / temperature)`` at the
sampled token, over the full vocabulary, *before* top-k/top-p filtering (temperature 0,
greedy, uses temperature 1). That is what the trainer recomputes from the same ids.

Routed experts (mixture-of-experts models, when the engine was asked to record them): row ``t`` of
``routed_experts`` holds, for each MoE layer, the ``top_k`` experts the engine's router chose for the
token fed at position ``t`` of ``prompt_ids + token_ids`` — every prompt token and every sampled token
but the last (which the engine never fed). Token-in, token-out like the ids: the rollout aligns them with
its trajectory, and the trainer can replay them (``actor.moe.routing_replay``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

EngineFinishReason = Literal["stop", "length", "abort"]

MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache")
"""What :meth:`RolloutEngine.resume_memory` can wake, in the order a rollout wakes them: the weights (the sync
then fills them), then the KV cache (once the actor's parameters have left the device)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion."""

    max_new_tokens: int
    """Most tokens to sample (the stop token counts)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Sampling one of these ends the completion (it is returned as the last id)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 keeps the whole vocabulary."""
    seed: int | None = None
    """Same seed, prompt and weights give the same completion."""
    draws_before: int = 0
    """This completion continues one that sampled this many tokens with the same ``seed`` (they end the prompt):
    a seeded engine draws as that one would have after them, so a generation cut at any token and continued
    under unchanged weights equals the uncut one (mid-turn partial rollouts)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")
        if self.draws_before < 0:
            raise ValueError(f"draws_before must be >= 0, got {self.draws_before}")


@dataclass(frozen=True)
class GenerationOutput:
    """What the engine sampled: ids, their logprobs (same length), and why it stopped."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: EngineFinishReason
    routed_experts: np.ndarray | None = None
    """``[len(prompt_ids) + len(token_ids) - 1, moe_layers, top_k]`` int16 expert ids (module docstring), or
    None when the engine records none."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.log_probs)} logprobs")
        if self.routed_experts is not None and self.routed_experts.ndim != 3:
            raise ValueError(f"routed_experts must be [tokens, moe_layers, top_k], got {self.routed_experts.shape}")
        if self.finish_reason not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish_reason {self.finish_reason!r}")


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine colocated with the trainer.

    Weight sync: ``update_weights`` may be called several times per sync (one bucket of
    Hugging Face-named tensors each), then ``finish_weight_update(version)`` once; only then, and only
    when the whole sync succeeded, does ``weight_version`` change, and no cache computed under the old
    weights (a prefix cache) survives it. Memory: ``release_memory`` frees weights and KV cache for
    the training phase; ``resume_memory(tags)`` re-allocates what ``tags`` names (:data:`MEMORY_TAGS`; None: all):
    ``"weights"`` before a sync (the weights must be synced again), ``"kv_cache"`` before generating. Each is
    idempotent. An engine with nothing to wake for a tag (transformers: no KV cache between requests) does nothing.

    Optional members: ``shutdown()``, ``drain(timeout_s)``, ``event_loop`` and ``prefix_cache_stats()`` (below). An
    engine may lack any of them (a test's scripted engine does), so callers read them only through this module's
    helpers, which say what their absence means: :func:`engine_shutdown` (nothing to stop), :func:`engine_drain`
    (nothing held: True), :func:`engine_event_loop` (None: any loop) and :func:`prefix_cache_stats` (None: no counts).
    hf, vLLM and SGLang have ``shutdown``, ``drain`` and ``prefix_cache_stats``; SGLang alone has ``event_loop``.

    Threads: an engine that runs its model on a thread of its own makes the engine's GPU that thread's current
    CUDA device first (:func:`bind_thread_to_device`): the current device is per thread and starts at GPU 0.
    Such an engine also has ``shutdown()`` (``Feed.close`` and ``serve`` call :func:`engine_shutdown`), which
    stops that thread and joins it: a daemon thread still ending as the interpreter finalises can free tensors
    without the GIL and abort the process after the run has finished.

    An engine whose async machinery is bound to one event loop exposes it as ``event_loop``
    (:func:`engine_event_loop`); :func:`~mcore_agentic.rollout.driver.generate_sequences_sync` then
    runs every rollout on that loop.

    Prefix cache (optional): ``prefix_cache_stats()`` returns a :class:`PrefixCacheStats`, cumulative since the
    engine was built: the prompt tokens of every request it admitted, and how many of them it served from KV it
    already held instead of computing them again (transformers: the LRU of conversations' caches, and a prompt
    several requests admitted together share, computed once; vLLM: its scheduler's prefix-cache hits; SGLang:
    ``meta_info.cached_tokens``). Read it with :func:`prefix_cache_stats`
    before and after a rollout and subtract: the feed reports the step's sums over the world and their ratio
    (``rollout/prefix_cache_prompt_tokens``, ``rollout/prefix_cache_hit_tokens``, ``rollout/prefix_cache_hit_rate``).

    Abort: ``generate(..., request_id=...)`` names a request (unique over the engine's life; None: the engine names
    it); ``abort(request_ids)`` ends those requests (None: every request queued or running). Each one's caller
    gets what was sampled so far with finish ``"abort"``, once the engine has dropped it (transformers: from its
    running batch at the next step; vLLM and SGLang: their own ``abort_request``), so a caller that awaits its
    ``generate`` knows the request is no longer live. An id aborted before its ``generate`` arrives is remembered:
    that call returns at once with finish ``"abort"`` and nothing sampled (the endpoint aborts a closed session's
    requests from another thread than the one that issues them). ``abort`` is thread-safe and never waits for a
    step. ``drain(timeout_s)`` (optional: :func:`engine_drain`) aborts every request and waits until none is left.
    """

    weight_version: int

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput: ...

    def abort(self, request_ids: Sequence[str] | None = None) -> None: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None: ...

    def finish_weight_update(self, version: int) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...

    def flush_cache(self) -> None: ...


@dataclass(frozen=True)
class PrefixCacheStats:
    """An engine's prompt tokens and the part of them served from a cache (:meth:`RolloutEngine` docstring)."""

    prompt_tokens: int = 0
    """Prompt tokens of the requests admitted (a request re-admitted after a preemption counts once)."""
    cached_tokens: int = 0
    """Of those, the tokens whose KV came from a cache (or from another request's prefill): not computed again."""

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        """``cached_tokens / prompt_tokens`` (0 with no prompt tokens)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __sub__(self, earlier: PrefixCacheStats) -> PrefixCacheStats:
        """What happened between an ``earlier`` reading and this one."""
        return PrefixCacheStats(self.prompt_tokens - earlier.prompt_tokens, self.cached_tokens - earlier.cached_tokens)


class AbortBook:
    """What an engine was told to abort (:meth:`RolloutEngine.abort`); thread-safe.

    ``abort(ids)`` remembers each id until a request of that id is seen (:meth:`hit`): it may be running, queued,
    or not yet issued. ``abort(None)`` moves the epoch on: every request issued before it (its :attr:`epoch` read
    when it was issued is older) is aborted; later ones are not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        self.epoch = 0

    def abort(self, request_ids: Sequence[str] | None) -> None:
        with self._lock:
            if request_ids is None:
                self.epoch += 1
            else:
                self._ids.update(request_ids)

    def hit(self, request_id: str | None, epoch: int | None = None) -> bool:
        """Whether the request ``request_id``, issued at ``epoch``, is aborted; its id is forgotten then."""
        with self._lock:
            if request_id is not None and request_id in self._ids:
                self._ids.discard(request_id)
                return True
            return epoch is not None and epoch < self.epoch


def aborted_output() -> GenerationOutput:
    """The result of a request aborted before it sampled anything."""
    return GenerationOutput([], [], "abort")


# The optional members (:class:`RolloutEngine`'s docstring): every caller reads them through these, the one place
# that knows an engine may lack one, and what its absence means.
def prefix_cache_stats(engine: object) -> PrefixCacheStats | None:
    """``engine.prefix_cache_stats()`` where the engine reports one, else None (no counts to report)."""
    report = getattr(engine, "prefix_cache_stats", None)
    return report() if callable(report) else None


def engine_event_loop(engine: object) -> asyncio.AbstractEventLoop | None:
    """``engine.event_loop``, the loop its async machinery is bound to; None (any loop will do) where it has none."""
    return getattr(engine, "event_loop", None)


def engine_drain(engine: object, timeout_s: float) -> bool:
    """``engine.drain(timeout_s)``: abort every request and wait up to ``timeout_s`` until none is left; whether none
    is. An engine without ``drain`` holds nothing between calls: True."""
    drain = getattr(engine, "drain", None)
    return bool(drain(timeout_s)) if callable(drain) else True


def engine_shutdown(engine: object) -> None:
    """``engine.shutdown()``: stop and join the engine's own threads; nothing for an engine without threads (or
    ``None``, a rank that holds no engine)."""
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()


def memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """``tags`` of a ``resume_memory`` call, checked, in :data:`MEMORY_TAGS` order; None means all of them."""
    if tags is None:
        return MEMORY_TAGS
    if isinstance(tags, str):
        raise TypeError(f"resume_memory(tags=...) takes a list of tags, got the string {tags!r}: write [{tags!r}]")
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}: resume_memory takes tags from {list(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if t in tags)


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the calling thread's current CUDA device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def bind_thread_to_device(device: torch.device) -> None:
    """Make ``device`` (a CUDA device with its index) the calling thread's current CUDA device; nothing off CUDA.

    The current CUDA device is per thread and a new thread starts on GPU 0: an engine's worker thread calls this
    before its first kernel, or every rank but local rank 0 would launch the kernels that take no explicit device
    (vLLM's Triton kernels, new tensors on ``cuda``) on GPU 0.
    """
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"bind_thread_to_device needs a CUDA device with its index, got {device}: resolve_device()")
        torch.cuda.set_device(device.index)


def deliver(future: asyncio.Future, loop: asyncio.AbstractEventLoop, result: GenerationOutput | BaseException) -> None:
    """Resolve a caller's ``future`` on its own event ``loop`` from an engine's worker thread.

    A future already done (cancelled by its caller) is left alone; a closed loop means nobody waits any more.
    """

    def resolve() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's loop is closed
        pass
