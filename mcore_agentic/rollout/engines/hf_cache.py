"""The transformers engine's KV caches (:mod:`~mcore_agentic.rollout.engines.hf`): finished requests' caches kept
for prefix reuse (:class:`PrefixStore`), and the per-layer (keys, values) form the running batch is cut and stacked in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Legacy = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values): [B, heads, T, head_dim]


@dataclass(eq=False)  # compared by identity (the LRU list removes the one object)
class Kept:
    """A finished request's KV cache: the ids it fed and, per layer, their keys and values ``[1, heads, T, dim]``."""

    ids: np.ndarray
    kv: Legacy
    routing: np.ndarray | None
    """``[T, moe_layers, top_k]`` routed experts of those ids (``record_routing``), else None."""
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixStore:
    """A bounded LRU of finished requests' KV caches (the transformers engine's
    module docstring), on the model's device.

    ``max_entries`` caches and ``max_bytes`` of keys and values in all; on CUDA a cache is also kept only while the
    device keeps ``min_free_fraction`` of its memory free after the copy. A cache whose ids extend a kept one's
    replaces it (everything the shorter served, the longer serves). Not thread-safe: the engine's worker holds the
    engine lock around every call.
    """

    def __init__(self, max_entries: int, max_bytes: int, *, min_free_fraction: float = 0.1):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_free_fraction = min_free_fraction
        self.entries: list[Kept] = []  # least recently used first
        self.nbytes = 0
        self.dropped = 0  # caches not kept (too large) or evicted, for tests and logs

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def lookup(self, prompt: np.ndarray) -> tuple[Kept | None, int]:
        """The kept cache sharing the longest prefix with ``prompt`` and that length, at most ``len(prompt) - 1``
        (the last prompt id is always fed: its logits sample the first token); ``(None, 0)`` when none shares one."""
        best, length = None, 0
        for entry in self.entries:
            n = common_prefix(entry.ids, prompt)
            if n >= length and n > 0:  # ties: the most recently used (later in the list)
                best, length = entry, n
        if best is None:
            return None, 0
        self.entries.remove(best)
        self.entries.append(best)
        return best, min(length, len(prompt) - 1)

    def fits(self, nbytes: int, device: torch.device) -> bool:
        if not self.enabled or nbytes > self.max_bytes:
            return False
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return free - nbytes >= self.min_free_fraction * total
        return True

    def add(self, ids: np.ndarray, kv: Legacy, routing: np.ndarray | None) -> None:
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        for entry in [e for e in self.entries if len(e.ids) <= len(ids) and common_prefix(e.ids, ids) == len(e.ids)]:
            self._drop(entry)  # the new cache extends it
        self.entries.append(Kept(ids, kv, routing, nbytes))
        self.nbytes += nbytes
        while len(self.entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(self.entries[0])
            self.dropped += 1

    def _drop(self, entry: Kept) -> None:
        self.entries.remove(entry)
        self.nbytes -= entry.nbytes

    def clear(self) -> None:
        self.entries, self.nbytes = [], 0


def to_legacy(cache: Any) -> Legacy:
    """Per-layer (keys, values) of a transformers ``DynamicCache`` (5.x dropped ``to_legacy_cache``)."""
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def from_legacy(legacy: Legacy) -> Any:
    """A ``DynamicCache`` holding per-layer (keys, values) (5.x dropped ``from_legacy_cache``)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    for layer, (keys, values) in enumerate(legacy):
        cache.update(keys, values, layer)
    return cache


def select_rows(cache: Legacy, rows: list[int]) -> Legacy:
    index = torch.tensor(rows, dtype=torch.long, device=cache[0][0].device)
    return tuple((k.index_select(0, index), v.index_select(0, index)) for k, v in cache)


def merge_caches(cache_a: Legacy, mask_a: torch.Tensor, cache_b: Legacy, mask_b: torch.Tensor) -> tuple[Legacy, torch.Tensor]:
    """Stack two batches' KV caches: left-pad the shorter with zeros (masked out) to a common length."""
    length = max(mask_a.shape[1], mask_b.shape[1])

    def pad_kv(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, length - t.shape[2], 0))

    def pad_mask(m: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(m, (length - m.shape[1], 0))

    merged = tuple(
        (torch.cat([pad_kv(ka), pad_kv(kb)]), torch.cat([pad_kv(va), pad_kv(vb)]))
        for (ka, va), (kb, vb) in zip(cache_a, cache_b)
    )
    return merged, torch.cat([pad_mask(mask_a), pad_mask(mask_b)])


__all__ = ["Legacy", "PrefixStore", "common_prefix"]
