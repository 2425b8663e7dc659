"""A transformers-backed rollout engine (CPU or one GPU) with request batching.

Concurrent ``generate`` calls are queued; a background task takes everything that
arrived within ``batch_window_s`` of the first pending request (up to
``max_batch_size``), left-pads the prompts and runs one batched sampling loop with a
KV cache in a worker thread, so the event loop (tools, other requests) keeps running.
Requests arriving while a batch decodes wait for the next batch: window batching,
not token-level continuous batching.

Sampling per row: logits of suppressed ids (the embedding table's padding rows past
the tokenizer, from ``generation_config.suppress_tokens``) are set to -inf; then
``/ temperature``; the recorded logprob is ``log_softmax`` of that at the sampled id
(before top-k/top-p filtering; temperature 0 = greedy with temperature-1 logprobs).
Each request samples from its own ``torch.Generator`` seeded by ``params.seed``, so
results do not depend on which requests share a batch.

Memory on CPU: :meth:`release_memory` moves the parameters to the ``meta`` device
(frees them; the small non-persistent buffers such as rotary frequencies are kept
aside); :meth:`resume_memory` allocates uninitialised storage, and ``generate``
refuses until the next completed weight sync fills it. There is no KV cache kept
between requests, so :meth:`flush_cache` has nothing to drop.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    future: asyncio.Future


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
        seed: int = 0,
    ):
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
        self.weight_version = 0
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # held while a batch runs or weights change
        self._released = False
        self._weights_invalid = False  # after resume_memory, until a finished sync
        self._synced: set[int] = set()
        self._kept_buffers: dict[str, torch.Tensor] = {}
        self._params = self._named_params()
        self.batches_run = 0  # for tests / metrics: how many batched sampling loops ran

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw: Any):
        """Load a local checkpoint directory (never downloads)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device)
        return cls(model, **kw)

    # -- generation ---------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self._check_usable()
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._worker is None or self._worker.done():
            # One queue and worker per event loop (a sync wrapper may run each batch in a fresh loop).
            self._loop, self._queue = loop, asyncio.Queue()
            self._worker = loop.create_task(self._serve())
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        pending = _Pending(list(prompt_ids), params, seed, loop.create_future())
        await self._queue.put(pending)
        return await pending.future

    async def _serve(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            batch = [await queue.get()]
            await asyncio.sleep(self.batch_window_s)  # let requests issued in the same tick join
            while not queue.empty() and len(batch) < self.max_batch_size:
                batch.append(queue.get_nowait())
            batch = [p for p in batch if not p.future.cancelled()]
            if not batch:
                continue
            try:
                outputs = await asyncio.to_thread(self._generate_batch, batch)
            except Exception as exc:  # noqa: BLE001 -- the callers get the error, the server keeps going
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, out in zip(batch, outputs):
                if not p.future.done():
                    p.future.set_result(out)

    @torch.no_grad()
    def _generate_batch(self, batch: list[_Pending]) -> list[GenerationOutput]:
        with self._lock:
            self._check_usable()
            self.batches_run += 1
            return self._sample_loop(batch)

    def _sample_loop(self, batch: list[_Pending]) -> list[GenerationOutput]:
        n = len(batch)
        lengths = [len(p.prompt_ids) for p in batch]
        width = max(lengths)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - lengths[r] :] = torch.tensor(p.prompt_ids)
            mask[r, width - lengths[r] :] = 1
        # Left padding: positions count real tokens only, as in an unpadded forward.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator().manual_seed(p.seed) for p in batch]
        out_ids: list[list[int]] = [[] for _ in batch]
        out_lps: list[list[float]] = [[] for _ in batch]
        finish: list[str | None] = [None] * n
        dev = self.device
        result = self.model(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=positions.to(dev), use_cache=True
        )
        step = 0
        while True:
            logits = result.logits[:, -1, :].float().cpu()
            next_tokens = torch.full((n,), self.pad_token_id, dtype=torch.long)
            for r, p in enumerate(batch):
                if finish[r] is not None:
                    continue
                token, logprob = self._sample_row(logits[r], p.params, generators[r])
                out_ids[r].append(token)
                out_lps[r].append(logprob)
                next_tokens[r] = token
                if token in p.params.stop_token_ids:
                    finish[r] = "stop"
                elif len(out_ids[r]) >= p.params.max_new_tokens:
                    finish[r] = "length"
            if all(f is not None for f in finish):
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
            step_pos = torch.tensor([[lengths[r] + step] for r in range(n)], dtype=torch.long)
            result = self.model(
                input_ids=next_tokens[:, None].to(dev),
                attention_mask=mask.to(dev),
                position_ids=step_pos.to(dev),
                past_key_values=result.past_key_values,
                use_cache=True,
            )
            step += 1
        return [GenerationOutput(out_ids[r], out_lps[r], finish[r]) for r in range(n)]  # type: ignore[arg-type]

    def _sample_row(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
        if self.suppress_token_ids:
            logits = logits.clone()
            logits[self.suppress_token_ids] = float("-inf")
        return sample_token(logits, params, gen)

    # -- weights and memory -------------------------------------------------------------------------

    def _named_params(self) -> dict[str, torch.Tensor]:
        """HF names of every parameter (tied aliases included) and persistent buffer."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(dict(self.model.named_buffers(remove_duplicate=False)))
        persistent = set(self.model.state_dict().keys())
        return {k: v for k, v in named.items() if k in persistent}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy a bucket of HF-named tensors into the model (strict names and shapes)."""
        if self._released:
            raise RuntimeError("HFEngine.update_weights while memory is released; call resume_memory() first")
        with self._lock, torch.no_grad():
            for name, tensor in named_tensors:
                target = self._params.get(name)
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
        if missing:
            raise ValueError(f"weight sync to version {version} left {len(missing)} tensors unset, e.g. {missing[:3]}")
        self.weight_version = version
        self._weights_invalid = False

    def release_memory(self) -> None:
        with self._lock:
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

    def resume_memory(self) -> None:
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
        """Nothing to flush: KV caches live only for one batch."""

    def _check_usable(self) -> None:
        if self._released:
            raise RuntimeError("HFEngine.generate while memory is released; call resume_memory() and sync weights")
        if self._weights_invalid:
            raise RuntimeError("HFEngine.generate after resume_memory() before a weight sync finished")


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """Sample one id from 1-D ``logits``; return it and its logprob under ``softmax(logits / T)``.

    Top-k then top-p filter the sampling distribution only; the logprob is taken before them
    (the documented convention of :mod:`mcore_agentic.rollout.engines.base`).
    """
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if params.temperature == 0:
        token = int(torch.argmax(scaled))
        return token, float(logprobs[token])
    filtered = scaled.clone()
    if params.top_k > 0 and params.top_k < filtered.numel():
        kth = torch.topk(filtered, params.top_k).values[-1]
        filtered[filtered < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        filtered[order[drop]] = float("-inf")
    probs = torch.softmax(filtered, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logprobs[token])
