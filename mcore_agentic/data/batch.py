"""The batch container that flows one way through the step: rollout -> experience -> update.

A :class:`Batch` holds named tensors that share a leading batch dimension and
named per-sample Python lists (messages, data sources, ground truths, ...).
Stages add keys with :meth:`Batch.update` and never mutate what an earlier stage
wrote. Key conventions (verl users know them):

========================  ===========  ===============================================
key                        shape        meaning
========================  ===========  ===============================================
``prompts``                [B, P]       prompt ids, left-padded
``responses``              [B, R]       response ids (all turns after the prompt), right-padded
``input_ids``              [B, P+R]     ``prompts`` ++ ``responses``
``attention_mask``         [B, P+R]     1 on real tokens
``position_ids``           [B, P+R]     0.. over real tokens
``response_mask``          [B, R]       loss mask: 1 exactly on policy-sampled tokens
``rollout_log_probs``      [B, R]       engine logprobs of sampled tokens (0 elsewhere)
``old_log_probs``          [B, R]       actor logprobs before the update
``ref_log_probs``          [B, R]       reference logprobs
``values``                 [B, R]       critic values
``token_level_scores``     [B, R]       rewards before KL
``token_level_rewards``    [B, R]       rewards after KL-in-reward
``advantages``/``returns`` [B, R]
========================  ===========  ===============================================
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    """Tensors with a shared leading dim plus per-sample lists (``meta``) and batch-level ``info``."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on batch size: {sizes}")

    def __repr__(self) -> str:
        """Shapes and keys, never the values: asyncio formats a finished task's result (Python 3.11's
        ``asyncio.run`` does at exit), and printing every tensor of a rollout batch takes seconds."""
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.tensors.items())
        return f"Batch(len={len(self)}, tensors[{shapes}], meta={sorted(self.meta)}, info={sorted(self.info)})"

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.meta:
            return self.meta[key]
        raise KeyError(f"Batch has no key {key!r}; tensors={sorted(self.tensors)}, meta={sorted(self.meta)}")

    def update(
        self, tensors: Mapping[str, torch.Tensor] | None = None, meta: Mapping[str, list[Any]] | None = None, **info: Any
    ) -> Batch:
        """A new batch with keys added (or replaced); this one is left untouched."""
        return Batch(
            tensors={**self.tensors, **(tensors or {})},
            meta={**self.meta, **{k: list(v) for k, v in (meta or {}).items()}},
            info={**self.info, **info},
        )

    def select(self, keys: Sequence[str]) -> Batch:
        """Only the named tensor/meta keys (info is kept)."""
        return Batch(
            tensors={k: self.tensors[k] for k in keys if k in self.tensors},
            meta={k: self.meta[k] for k in keys if k in self.meta},
            info=dict(self.info),
        )

    def index(self, idx: torch.Tensor | Sequence[int] | slice) -> Batch:
        """Rows ``idx`` of every field."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        else:
            rows = [int(i) for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx)]
        index = torch.tensor(rows, dtype=torch.long)
        return Batch(
            tensors={k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()},
            meta={k: [v[i] for i in rows] for k, v in self.meta.items()},
            info=dict(self.info),
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` rows (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """``n`` equal pieces; the batch size must divide evenly (e.g. across DP ranks)."""
        if len(self) % n:
            raise ValueError(f"batch of {len(self)} does not split into {n} equal chunks")
        return self.split(len(self) // n)

    def iter_minibatches(self, size: int, *, shuffle: bool, generator: torch.Generator | None = None) -> Iterator[Batch]:
        """Mini-batches for PPO epochs; ``shuffle`` permutes rows with ``generator`` first."""
        order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
        for i in range(0, len(self), size):
            yield self.index(order[i : i + size])

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta), dict(self.info))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches, in order; every batch must have the same keys."""
        if not batches:
            return Batch()
        keys_t, keys_m = set(batches[0].tensors), set(batches[0].meta)
        for b in batches[1:]:
            if set(b.tensors) != keys_t or set(b.meta) != keys_m:
                raise ValueError("cannot concat batches with different keys")
        info: dict[str, Any] = {}
        for b in batches:
            info.update(b.info)
        return Batch(
            tensors={k: torch.cat([b.tensors[k] for b in batches]) for k in keys_t},
            meta={k: [x for b in batches for x in b.meta[k]] for k in keys_m},
            info=info,
        )
