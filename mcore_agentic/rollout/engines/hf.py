"""A transformers-backed rollout engine (CPU or one GPU) with continuous batching.

One module over ~500 lines: what remains is the one engine class, whose scheduler (admission, prefill with
prefix reuse, decoding steps, aborts), weight sync and memory calls share its worker thread, lock and running
batch; its KV caches (:mod:`~mcore_agentic.rollout.engines.hf_cache`) and per-request sampling
(:mod:`~mcore_agentic.rollout.engines.hf_sampling`) live beside it.

``generate`` calls from any event loop go to one worker thread that owns a running
batch. Each iteration it either admits waiting requests (one prefill forward over
them, left-padded, then their KV caches are left-padded to the running batch's length
and concatenated to it) or runs one decoding step for every running request. A
finished request leaves the batch at once and its caller resumes; a request that
arrives mid-flight joins at the next iteration instead of waiting for the batch to
drain. The event loop (tools, other requests) never blocks on the model.

Sampling per row: logits of suppressed ids (the embedding table's padding rows past
the tokenizer, from ``generation_config.suppress_tokens``) are set to -inf; then
``/ temperature``; the recorded logprob is ``log_softmax`` of that at the sampled id
(before top-k/top-p filtering; temperature 0 = greedy with temperature-1 logprobs).
Each request samples from its own ``torch.Generator`` seeded by ``params.seed``, so
the ids do not depend on which requests share a step (logprobs agree to float
rounding of the padded batched forward). A request that continues a cut generation
(``params.draws_before``) starts from its generator advanced past that many draws (each sampled token
draws one vocabulary-wide ``exponential_``, inside ``torch.multinomial``), so it equals the uncut one; the
advance costs ``draws_before`` such draws.

Routed experts (``record_routing=True``, mixture-of-experts models): a forward hook on every MoE layer's
router (``model.layers.L.mlp.gate``, whose third output is the chosen expert ids) keeps each forward's
top-k; a prefill hands each row its prompt tokens' rows (left padding dropped), a decoding step the row of
the token it fed. A finished request returns them as ``GenerationOutput.routed_experts``.

Prefix reuse (:class:`PrefixStore`): a finished request leaves its KV cache — the ids it fed, its prompt and
its samples but the last — in a small LRU (``prefix_cache_entries`` caches, ``prefix_cache_bytes`` in all; a
new cache drops those whose ids it extends). A request whose prompt shares a prefix with a kept cache (a
conversation's next turn: prompt + samples + the new environment tokens; or another conversation with the same
system prompt and tools) takes that prefix's keys and values and prefills only the rest. Causal attention makes
the reused part exact: a position's keys and values depend only on the ids up to it, and the rotary phases are
those of the same positions; the log-probs equal the no-reuse path's to float rounding (a padded batched forward's,
as above). Batching: an admission runs at most two prefill forwards, one over the requests that reuse at least
half of their prompt (their caches left-padded to the longest reuse, their new ids left-padded after them, with
masked holes between), one over the others as before (a short common prefix, a chat template's first ids, is
not worth widening that batch's keys). Requests admitted together with the same prompt (a group's ``n`` samples)
share one row of the forward, which their rows then copy (with the store on). :meth:`prefix_cache_stats` counts
the prompt tokens admitted and those not computed for them (reused, or computed once for several). A weight update,
:meth:`flush_cache` and :meth:`release_memory` drop every kept cache.

Memory: :meth:`release_memory` moves the parameters to the ``meta`` device
(frees them; the small non-persistent buffers such as rotary frequencies are kept
aside); :meth:`resume_memory` (tag ``weights``) allocates uninitialised storage, and ``generate``
refuses until the next completed weight sync fills it. Weights and memory may only
change while no request is running. A running request's KV cache lives in the running batch; only the prefix
store outlives requests, so the ``kv_cache`` tag has nothing to allocate.

Abort (:meth:`HFEngine.abort`): the scheduler drops the requests named (or every one) before its next forward —
a running row leaves the batch with what it sampled, a queued request with nothing — and each caller gets finish
``abort``; :meth:`HFEngine.drain` aborts everything and waits until the scheduler holds no request.

Device: the worker thread makes the model's GPU its current CUDA device before its first
forward (a new thread's current device is GPU 0).
"""

from __future__ import annotations

import asyncio
import queue
import random
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mcore_agentic.rollout.engines.base import (
    AbortBook,
    GenerationOutput,
    PrefixCacheStats,
    SamplingParams,
    aborted_output,
    bind_thread_to_device,
    deliver,
    memory_tags,
)
from mcore_agentic.rollout.engines.hf_cache import (
    Kept,
    Legacy,
    PrefixStore,
    from_legacy,
    merge_caches,
    select_rows,
    to_legacy,
)
from mcore_agentic.rollout.engines.hf_sampling import advance_draws, sample_token

_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MOE_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


_SHUTDOWN = object()
"""Put on the inbox by :meth:`HFEngine.shutdown`: the scheduler thread fails what it holds and exits."""


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    request_id: str | None = None
    epoch: int = 0
    """:attr:`AbortBook.epoch` when it was issued (``abort()`` of every request aborts the older ones)."""


@dataclass
class _Row:
    """One running request: tokens fed so far are in the KV cache; ``last`` is sampled, not yet fed."""

    req: _Pending
    generator: torch.Generator
    next_position: int
    last: int = -1
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    """Routed experts of the tokens fed so far, ``[tokens, moe_layers, top_k]`` pieces (``record_routing``)."""
    finish: str = ""
    """Why it finished (``stop``, ``length``), once it has."""


class HFEngine:
    """``RolloutEngine`` over a Hugging Face causal LM held in this process."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int | None = None,
        suppress_token_ids: Iterable[int] | None = None,
        max_batch_size: int = 64,
        batch_window_s: float = 0.005,
        idle_exit_s: float = 1.0,
        seed: int = 0,
        record_routing: bool = False,
        prefix_cache_entries: int = 4,
        prefix_cache_bytes: int = 1 << 30,
    ):
        """``prefix_cache_entries``/``prefix_cache_bytes``: the :class:`PrefixStore`'s bounds (0: no reuse)."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        config = model.config
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else (config.pad_token_id or 0))
        if suppress_token_ids is None:
            gen_cfg = getattr(model, "generation_config", None)
            suppress_token_ids = getattr(gen_cfg, "suppress_tokens", None) or []
        self.suppress_token_ids = sorted(int(i) for i in suppress_token_ids)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.idle_exit_s = idle_exit_s
        self.weight_version = 0
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self._inbox: queue.Queue[_Pending] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._lock = threading.Lock()  # held while the model runs or weights change
        self._active = 0  # running requests (owned by the worker thread)
        self._aborts = AbortBook()
        self._count_lock = threading.Lock()
        self._submitted = 0  # requests put on the inbox ...
        self._answered = 0  # ... and those the scheduler has let go of (answered, or dropped when cancelled)
        self._released = False
        self._shut_down = False
        self._weights_invalid = False  # after resume_memory, until a finished sync
        self._synced: set[int] = set()
        self._expert_parts: dict[int, set[str]] = {}  # fused expert tensor -> the per-expert names received
        self._kept_buffers: dict[str, torch.Tensor] = {}
        self._params = self._named_params()
        self._routed: list[torch.Tensor | None] = []  # this forward's expert ids per MoE layer
        self.record_routing = record_routing
        if record_routing:
            self._hook_routers()
        self.prefix_store = PrefixStore(prefix_cache_entries, prefix_cache_bytes)
        self._prompt_tokens = 0  # admitted (prefix_cache_stats)
        self._cached_tokens = 0  # of those, served from the prefix store
        # statistics, for tests and logs
        self.prefills_run = 0
        self.steps_run = 0
        self.max_rows_per_step = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw: Any):
        """Load a local checkpoint directory (never downloads)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device)
        return cls(model, **kw)

    # -- routed experts -----------------------------------------------------------------------------

    def _hook_routers(self) -> None:
        """Keep the expert ids every MoE router of the model chooses (its third output), in layer order."""
        routers = []
        for name, module in self.model.named_modules():
            match = _MOE_ROUTER.search(name)
            if match is not None and hasattr(module, "top_k"):
                routers.append((int(match.group(1)), module))
        if not routers:
            raise ValueError("HFEngine(record_routing=True) needs a mixture-of-experts model (no `layers.L.mlp.gate` "
                             "router found): set actor.moe.routing_replay=disable for a dense model")
        routers.sort(key=lambda item: item[0])
        self._routed = [None] * len(routers)
        for ordinal, (_, module) in enumerate(routers):
            module.register_forward_hook(partial(self._keep_routing, ordinal))

    def _keep_routing(self, ordinal: int, module: Any, args: Any, output: Any) -> None:
        self._routed[ordinal] = output[2]

    def _forward_routing(self) -> torch.Tensor | None:
        """``[tokens, moe_layers, top_k]`` int16 of the forward just run (None when not recording)."""
        if not self.record_routing:
            return None
        if any(t is None for t in self._routed):
            raise RuntimeError("a MoE router produced no expert ids in this forward")
        out = torch.stack([t for t in self._routed if t is not None], dim=1).to(torch.int16).cpu()
        self._routed = [None] * len(self._routed)
        return out

    # -- generation ---------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self._check_usable()
        if self._aborts.hit(request_id):  # aborted before it was issued
            return aborted_output()
        loop = asyncio.get_running_loop()
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        pending = _Pending(list(prompt_ids), params, seed, loop.create_future(), loop, request_id, self._aborts.epoch)
        with self._count_lock:
            self._submitted += 1
        self._inbox.put(pending)
        self._ensure_worker()
        return await pending.future

    def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the requests ``request_ids`` names (None: every request issued so far); the scheduler drops them
        before its next forward and each caller gets finish ``abort`` with what it sampled. Returns at once."""
        self._aborts.abort(request_ids)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Abort every request and wait, at most ``timeout_s``, until the scheduler holds none; whether it holds none."""
        self.abort()
        deadline = time.monotonic() + timeout_s
        while not self._idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def _idle(self) -> bool:
        with self._count_lock:
            return self._answered == self._submitted

    def _ensure_worker(self) -> None:
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="hf-engine", daemon=True)
                self._thread.start()

    def _worker(self) -> None:
        """The scheduler: admit waiting requests, else step the running ones; exit when idle."""
        bind_thread_to_device(self.device)  # a new thread's current CUDA device is GPU 0
        rows: list[_Row] = []
        cache: Legacy | None = None
        mask: torch.Tensor | None = None
        while True:
            incoming: list[_Pending] = []
            if not rows:
                try:
                    incoming.append(self._inbox.get(timeout=self.idle_exit_s))
                except queue.Empty:
                    with self._thread_lock:
                        if self._inbox.empty():
                            self._thread = None
                            return
                    continue
                time.sleep(self.batch_window_s)  # let requests issued together share the prefill
            while len(rows) + len(incoming) < self.max_batch_size:
                try:
                    incoming.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if any(p is _SHUTDOWN for p in incoming):
                stopped = RuntimeError("the HF engine was shut down")
                held = [r.req for r in rows] + [p for p in incoming if p is not _SHUTDOWN]
                for pending in held:
                    _deliver(pending, stopped)
                self._answer(len(held))
                with self._thread_lock:
                    self._thread = None
                return
            held = len(rows) + len(incoming)
            try:
                with self._lock, torch.no_grad():
                    rows, cache, mask, incoming = self._drop_aborted(rows, cache, mask, incoming)
                    incoming = [p for p in incoming if not p.future.cancelled()]
                    self._check_usable()
                    if incoming:
                        rows, cache, mask = self._admit(rows, cache, mask, incoming)
                    elif rows:
                        rows, cache, mask = self._step(rows, cache, mask)
                    self._active = len(rows)
            except Exception as exc:  # noqa: BLE001 -- every affected caller gets the error; the worker goes on
                for pending in [r.req for r in rows] + incoming:
                    _deliver(pending, exc)
                rows, cache, mask = [], None, None
                self._active = 0
            self._answer(held - len(rows))

    def _answer(self, count: int) -> None:
        """``count`` requests left the scheduler (answered, failed, aborted, or dropped when their caller gave up)."""
        with self._count_lock:
            self._answered += count

    def _drop_aborted(
        self, rows: list[_Row], cache: Legacy | None, mask: torch.Tensor | None, incoming: list[_Pending]
    ) -> tuple[list[_Row], Legacy | None, torch.Tensor | None, list[_Pending]]:
        """Answer the aborted requests (:meth:`abort`) with what they sampled and drop them: from ``incoming``, and
        from the running batch (its KV cache and mask with it)."""
        waiting = []
        for p in incoming:
            if self._aborts.hit(p.request_id, p.epoch):
                _deliver(p, aborted_output())
            else:
                waiting.append(p)
        keep = [i for i, r in enumerate(rows) if not self._aborts.hit(r.req.request_id, r.req.epoch)]
        if len(keep) == len(rows):
            return rows, cache, mask, waiting
        for i in sorted(set(range(len(rows))) - set(keep)):
            _deliver(rows[i].req, self._output(rows[i], "abort"))
        if not keep:
            return [], None, None, waiting
        assert cache is not None and mask is not None
        return [rows[i] for i in keep], select_rows(cache, keep), mask[keep], waiting

    def _admit(
        self, rows: list[_Row], cache: Legacy | None, mask: torch.Tensor | None, incoming: list[_Pending]
    ) -> tuple[list[_Row], Legacy | None, torch.Tensor | None]:
        """Prefill ``incoming`` (at most two forwards: those that reuse a kept cache for at least half their prompt,
        and the others), sample their first tokens, and merge the survivors into the running batch."""
        reusing: list[tuple[_Pending, Kept | None, int]] = []
        fresh: list[tuple[_Pending, Kept | None, int]] = []
        for p in incoming:
            kept, length = None, 0
            if self.prefix_store.entries:
                kept, length = self.prefix_store.lookup(np.asarray(p.prompt_ids, dtype=np.int64))
            if kept is not None and length > 0 and 2 * length >= len(p.prompt_ids):
                reusing.append((p, kept, length))
            else:
                fresh.append((p, None, 0))
        for group in (fresh, reusing):
            if group:
                new_rows, new_cache, new_mask = self._prefill(group)
                if not new_rows:
                    continue
                if not rows:
                    rows, cache, mask = new_rows, new_cache, new_mask
                else:
                    assert cache is not None and mask is not None and new_cache is not None and new_mask is not None
                    cache, mask = merge_caches(cache, mask, new_cache, new_mask.to(mask.device))
                    rows = rows + new_rows
        return rows, cache, mask

    def _prefill(
        self, requests: list[tuple[_Pending, Kept | None, int]]
    ) -> tuple[list[_Row], Legacy | None, torch.Tensor | None]:
        """One forward over the requests' prompts past their reused lengths, each row laid out as
        ``[pad | reused KV | pad | new ids]`` (the reused KV as past keys), a prompt that several requests share
        (a group's ``n`` samples) once; sample each request's first token."""
        rows_of: dict[Any, int] = {}
        share = self.prefix_store.enabled  # no reuse: every request computes its own prompt
        expand = [rows_of.setdefault((id(kept), length, tuple(p.prompt_ids)) if share else i, len(rows_of))
                  for i, (p, kept, length) in enumerate(requests)]
        group = [requests[expand.index(u)] for u in range(len(rows_of))]  # the distinct prompts, first seen first
        reused = [length for _, _, length in group]
        tails = [p.prompt_ids[length:] for p, _, length in group]
        past, width = max(reused), max(len(t) for t in tails)
        n = len(group)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, past + width), dtype=torch.long)
        for r, tail in enumerate(tails):
            ids[r, width - len(tail) :] = torch.tensor(tail)
            mask[r, past - reused[r] : past] = 1
            mask[r, past + width - len(tail) :] = 1
        # Positions count real tokens only, as in an unpadded forward.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        dev = self.device
        past_kv = from_legacy(self._past(group, past)) if past else None
        out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=positions.to(dev),
                         past_key_values=past_kv, use_cache=True)
        self.prefills_run += 1
        computed = sum(len(t) for t in tails)
        total = sum(len(p.prompt_ids) for p, _, _ in requests)
        self._prompt_tokens += total
        self._cached_tokens += total - computed  # reused, or computed once for several requests
        new_rows = [_Row(p, torch.Generator().manual_seed(p.seed), next_position=len(p.prompt_ids))
                    for p, _, _ in requests]
        routed = self._forward_routing()
        if routed is not None:  # [rows x width, L, k], left-padded rows: keep each row's new prompt tokens
            routed = routed.view(n, width, *routed.shape[1:])
            for row, u, (_, kept, length) in zip(new_rows, expand, requests):
                if length:
                    assert kept is not None and kept.routing is not None
                    row.routing.append(kept.routing[:length])
                row.routing.append(routed[u, width - len(tails[u]) :].numpy())
        legacy, logits = to_legacy(out.past_key_values), out.logits[:, -1, :]
        if n < len(requests):  # each request its prompt's row
            legacy, logits, mask = select_rows(legacy, expand), logits[expand], mask[expand]
        keep, finished = self._sample_all(new_rows, logits)
        self._finish(new_rows, finished, legacy, mask)
        if not keep:
            return [], None, None
        return [new_rows[i] for i in keep], select_rows(legacy, keep), mask[keep]

    def _past(self, group: list[tuple[_Pending, Kept | None, int]], past: int) -> Legacy:
        """The reused keys and values of ``group``, each row's right-aligned in ``past`` columns (zeros before)."""
        if len(group) == 1:
            kept, length = group[0][1], group[0][2]
            assert kept is not None
            return tuple((k[:, :, :length], v[:, :, :length]) for k, v in kept.kv)
        like = next(kept for _, kept, _ in group if kept is not None).kv
        layers = []
        for layer, (k0, v0) in enumerate(like):
            keys = k0.new_zeros((len(group), k0.shape[1], past, k0.shape[3]))
            values = v0.new_zeros((len(group), v0.shape[1], past, v0.shape[3]))
            for r, (_, kept, length) in enumerate(group):
                if length:
                    assert kept is not None
                    keys[r, :, past - length :] = kept.kv[layer][0][0, :, :length]
                    values[r, :, past - length :] = kept.kv[layer][1][0, :, :length]
            layers.append((keys, values))
        return tuple(layers)

    def _keep_finished(self, rows: list[_Row], finished: list[int], legacy: Legacy, mask: torch.Tensor) -> None:
        """Put each finished row's KV cache (the ids it fed: its prompt and its samples but the last) in the
        prefix store, when it fits."""
        store = self.prefix_store
        if not store.enabled:
            return
        per_token = sum(k.shape[1] * k.shape[3] * k.element_size() + v.shape[1] * v.shape[3] * v.element_size()
                        for k, v in legacy)
        for i in finished:
            row = rows[i]
            fed = row.req.prompt_ids + row.out_ids[:-1]
            if not store.fits(per_token * len(fed), self.device):
                store.dropped += 1
                continue
            columns = mask[i].nonzero().squeeze(-1)
            if len(columns) != len(fed):
                raise RuntimeError(f"a finished row holds {len(columns)} cached positions for {len(fed)} fed ids")
            columns = columns.to(legacy[0][0].device)
            kv = tuple((k[i : i + 1].index_select(2, columns), v[i : i + 1].index_select(2, columns))
                       for k, v in legacy)
            routing = np.concatenate(row.routing) if row.routing else None
            store.add(np.asarray(fed, dtype=np.int64), kv, routing)

    def _step(
        self, rows: list[_Row], cache: Legacy, mask: torch.Tensor
    ) -> tuple[list[_Row], Legacy | None, torch.Tensor | None]:
        """Feed every row its last sampled token, sample the next one, drop finished rows."""
        n = len(rows)
        tokens = torch.tensor([[r.last] for r in rows], dtype=torch.long)
        positions = torch.tensor([[r.next_position] for r in rows], dtype=torch.long)
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        dev = self.device
        out = self.model(
            input_ids=tokens.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions.to(dev),
            past_key_values=from_legacy(cache),
            use_cache=True,
        )
        self.steps_run += 1
        self.max_rows_per_step = max(self.max_rows_per_step, n)
        routed = self._forward_routing()
        if routed is not None:  # one fed token per row
            for i, row in enumerate(rows):
                row.routing.append(routed[i : i + 1].numpy())
        for r in rows:
            r.next_position += 1
        legacy = to_legacy(out.past_key_values)
        keep, finished = self._sample_all(rows, out.logits[:, -1, :])
        self._finish(rows, finished, legacy, mask)
        if not keep:
            return [], None, None
        if len(keep) < n:
            legacy, mask, rows = select_rows(legacy, keep), mask[keep], [rows[i] for i in keep]
        # Drop leading columns that are padding for every remaining row.
        first = int(mask.any(dim=0).long().argmax())
        if first > 0:
            legacy = tuple((k[:, :, first:], v[:, :, first:]) for k, v in legacy)
            mask = mask[:, first:]
        return rows, legacy, mask

    def _sample_all(self, rows: list[_Row], logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Sample one token per row; return the indices of the rows to go on and of the finished ones (not yet
        delivered: :meth:`_finish`)."""
        logits = logits.float().cpu()
        if self.suppress_token_ids:
            logits[:, self.suppress_token_ids] = float("-inf")
        keep, finished = [], []
        for i, row in enumerate(rows):
            if row.req.future.cancelled():  # the caller gave up: free the row
                continue
            params = row.req.params
            if not row.out_ids and params.draws_before and params.temperature > 0 and params.seed is not None:
                advance_draws(row.generator, params.draws_before, logits.shape[-1])
            token, logprob = sample_token(logits[i], params, row.generator)
            row.out_ids.append(token)
            row.out_lps.append(logprob)
            row.last = token
            if token in params.stop_token_ids:
                row.finish = "stop"
                finished.append(i)
            elif len(row.out_ids) >= params.max_new_tokens:
                row.finish = "length"
                finished.append(i)
            else:
                keep.append(i)
        return keep, finished

    def _finish(self, rows: list[_Row], finished: list[int], legacy: Legacy, mask: torch.Tensor) -> None:
        """Keep the finished rows' caches in the prefix store, then deliver their results (so the caller's next
        turn, or a reader of the store, finds the cache)."""
        try:
            self._keep_finished(rows, finished, legacy, mask)
        finally:
            for i in finished:
                _deliver(rows[i].req, self._output(rows[i], rows[i].finish))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens admitted since the engine was built, and those whose KV came from the prefix store."""
        return PrefixCacheStats(self._prompt_tokens, self._cached_tokens)

    def _output(self, row: _Row, reason: str) -> GenerationOutput:
        routed = np.concatenate(row.routing) if row.routing else None
        return GenerationOutput(row.out_ids, row.out_lps, reason, routed_experts=routed)  # type: ignore[arg-type]

    # -- weights and memory -------------------------------------------------------------------------

    def _named_params(self) -> dict[str, torch.Tensor]:
        """HF names of every parameter (tied aliases included) and persistent buffer."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(dict(self.model.named_buffers(remove_duplicate=False)))
        persistent = set(self.model.state_dict().keys())
        return {k: v for k, v in named.items() if k in persistent}

    def _expert_slice(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a per-expert checkpoint name (``…experts.{e}.gate_proj/up_proj/down_proj.weight``, what the trainer
        exports and transformers writes to disk) of a model holding its experts fused in memory
        (``…experts.gate_up_proj`` [E, 2I, H], ``…experts.down_proj`` [E, H, I]): the fused tensor, the view of
        that expert's part of it, and how many such parts the fused tensor has. None for other names."""
        match = _PER_EXPERT.match(name)
        if match is None:
            return None
        prefix, e, proj = match.group(1), int(match.group(2)), match.group(3)
        fused = self._params.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
            return None
        if proj == "down_proj":
            return fused, fused[e], fused.shape[0]
        inner = fused.shape[1] // 2
        return fused, (fused[e, :inner] if proj == "gate_proj" else fused[e, inner:]), 2 * fused.shape[0]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy a bucket of HF-named tensors into the model (strict names and shapes; per-expert names fill
        the model's fused expert tensors part by part)."""
        if self._released:
            raise RuntimeError("HFEngine.update_weights while memory is released; call resume_memory() first")
        with self._lock, torch.no_grad():
            self._check_idle("update_weights")
            self.prefix_store.clear()  # computed under the weights being replaced
            for name, tensor in named_tensors:
                target = self._params.get(name)
                expert = self._expert_slice(name) if target is None else None
                if expert is not None:
                    fused, view, parts = expert
                    if tuple(view.shape) != tuple(tensor.shape):
                        raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != engine's {tuple(view.shape)}")
                    view.copy_(tensor.to(device=view.device, dtype=view.dtype))
                    seen = self._expert_parts.setdefault(id(fused), set())
                    seen.add(name)
                    if len(seen) == parts:
                        self._synced.add(id(fused))
                    continue
                if target is None:
                    example = next(iter(self._params))
                    raise KeyError(f"weight {name!r} is not in the engine's model (HF names, e.g. {example!r})")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != engine's {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                self._synced.add(id(target))

    def finish_weight_update(self, version: int) -> None:
        """End a sync: every tensor must have been sent (any tied alias counts); bump ``weight_version``."""
        missing = sorted(name for name, t in self._params.items() if id(t) not in self._synced)
        self._synced.clear()
        self._expert_parts.clear()
        if missing:
            raise ValueError(f"weight sync to version {version} left {len(missing)} tensors unset, e.g. {missing[:3]}")
        self.weight_version = version
        self._weights_invalid = False

    def release_memory(self) -> None:
        with self._lock:
            self._check_idle("release_memory")
            self.prefix_store.clear()
            if not self._released:
                # Non-persistent buffers (rotary inv_freq, ...) are not part of a weight sync: keep them.
                persistent = set(self.model.state_dict().keys())
                self._kept_buffers = {
                    name: buf.detach().clone()
                    for name, buf in self.model.named_buffers()
                    if name not in persistent
                }
                self.model.to(device="meta")
                self._released = True

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``weights``: allocate the parameters again (a sync must fill them); ``kv_cache``: nothing to allocate."""
        if "weights" not in memory_tags(tags):
            return
        with self._lock:
            if self._released:
                self.model.to_empty(device=self.device)
                if getattr(self.model.config, "tie_word_embeddings", False):
                    self.model.tie_weights()
                buffers = dict(self.model.named_buffers())
                with torch.no_grad():
                    for name, value in self._kept_buffers.items():
                        buffers[name].copy_(value)
                self._kept_buffers = {}
                self._params = self._named_params()
                self._released = False
                self._weights_invalid = True

    def flush_cache(self) -> None:
        """Drop the prefix store's caches (running requests keep theirs)."""
        with self._lock:
            self.prefix_store.clear()

    def shutdown(self) -> None:
        """Stop the scheduler thread and wait for it; requests still queued or running get an error.

        The thread otherwise lingers for ``idle_exit_s`` after the last request. One still alive when the process
        exits can drop the last reference to the model from a daemon thread while the interpreter finalises: it
        frees tensors after the GIL is gone and the process aborts (``terminate called without an active
        exception``) after the run has finished.
        """
        with self._thread_lock:
            self._shut_down = True
            thread = self._thread
            if thread is not None:
                self._inbox.put(_SHUTDOWN)  # type: ignore[arg-type]
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _check_idle(self, what: str) -> None:
        if self._active:
            raise RuntimeError(f"HFEngine.{what} while {self._active} requests are generating; wait for the rollout to end")

    def _check_usable(self) -> None:
        if self._shut_down:
            raise RuntimeError("HFEngine.generate after shutdown()")
        if self._released:
            raise RuntimeError("HFEngine.generate while memory is released; call resume_memory() and sync weights")
        if self._weights_invalid:
            raise RuntimeError("HFEngine.generate after resume_memory() before a weight sync finished")


def _deliver(pending: _Pending, result: GenerationOutput | BaseException) -> None:
    deliver(pending.future, pending.loop, result)
