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
``teacher_log_probs``      [B, R]       a distillation teacher's logprobs of the sampled tokens
``teacher_top_k_*``        [B, R, k]    its ``k`` most likely next tokens at each response position (``_ids``, int64)
                                        and their logprobs (``_log_probs``), ``algorithm.distillation.top_k``
``routed_experts``         [B, P+R,     the experts the engine's routers chose per token (mixture-of-experts,
                           L, k]        ``actor.moe.routing_replay``); aligned with ``input_ids``, -1 on padding
========================  ===========  ===============================================

The first five keys (the layout) are built in one place: :func:`build_rollout_layout` from
per-sample id lists (the rollout's collation, the SFT warm start, benches), and
:func:`repad_rollout_layout` from an already padded batch widened to other widths (the
gather of several rollout groups' batches). Widths default to the longest row, at least 1;
pads are ``pad_token_id`` in ``prompts``/``responses`` and 0 in every other key.

Which keys cross the feed -> trainer seam (dtype, filler value, producer, the setting that wants each) is one
table, ``mcore_agentic/feed/fields.py``; its per-token fields are :data:`TOKEN_FIELDS`.
"""

from __future__ import annotations

import array
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


# ----------------------------------------------------------------------------------- layout
Row = Sequence[int] | Sequence[float] | torch.Tensor
"""One sample's tokens (or per-token values): a list, or a 1-D tensor."""

LAYOUT_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids")
"""The keys the layout builders write; every other key is a token field, a response field or per-sample ``[B]``."""

TOKEN_FIELDS = ("routed_experts",)
"""Keys aligned with ``input_ids`` (``[B, P+R, ...]``): a left-padded prompt part and a right-padded response part,
-1 on padding."""


def build_token_field(
    rows: Sequence[torch.Tensor | Any | None], prompt_lens: Sequence[int], *, prompt_width: int, response_width: int
) -> torch.Tensor:
    """One token field ``[B, P+R, ...]`` from per-sample values over the sample's tokens (prompt then response;
    ``prompt_lens`` splits them; None: unknown), -1 on padding and unknown tokens."""
    shaped = [torch.as_tensor(r) for r in rows if r is not None]
    if not shaped:
        raise ValueError("a token field needs at least one sample with values")
    tail, dtype = tuple(shaped[0].shape[1:]), shaped[0].dtype
    out = torch.full((len(rows), prompt_width + response_width, *tail), -1, dtype=dtype)
    for i, (row, p) in enumerate(zip(rows, prompt_lens)):
        if row is None:
            continue
        row = torch.as_tensor(row)
        if tuple(row.shape[1:]) != tail:
            raise ValueError(f"token field row {i} has {tuple(row.shape[1:])} values per token, another {tail}")
        r = len(row) - p
        if p > prompt_width or r > response_width or r < 0:
            raise ValueError(f"token field row {i} ({p}+{r} tokens) does not fit [{prompt_width}+{response_width}]")
        out[i, prompt_width - p : prompt_width] = row[:p]
        out[i, prompt_width : prompt_width + r] = row[p:]
    return out

_TYPECODES = {torch.int64: "q", torch.float32: "f"}


def build_rollout_layout(
    prompts: Sequence[Row],
    responses: Sequence[Row],
    *,
    pad_token_id: int,
    response_fields: Mapping[str, tuple[Sequence[Row], torch.dtype]] | None = None,
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> dict[str, torch.Tensor]:
    """The padded rollout layout of per-sample prompt and response ids (conventions in the module docstring).

    Returns ``prompts`` [B, P] (int64, left-padded with ``pad_token_id``), ``responses`` [B, R]
    (int64, right-padded with ``pad_token_id``), ``input_ids``/``attention_mask``/``position_ids``
    [B, P+R] (int64; mask 1 on real tokens, positions ``0..`` over them, 0 on padding), then one
    [B, R] tensor per ``response_fields`` entry ``name: (rows, dtype)``, right-padded with 0;
    each of its rows must be as long as the sample's response. ``P``/``R``: ``prompt_width``/
    ``response_width``, by default the longest row (at least 1).
    """
    b = len(prompts)
    if len(responses) != b:
        raise ValueError(f"{b} prompts but {len(responses)} responses")
    fields = dict(response_fields or {})
    for name, (rows, _) in fields.items():
        if len(rows) != b:
            raise ValueError(f"response field {name!r} has {len(rows)} rows for {b} samples")
        for i, (row, resp) in enumerate(zip(rows, responses)):
            if len(row) != len(resp):
                raise ValueError(f"response field {name!r} row {i} has {len(row)} values for {len(resp)} tokens")
    p = _width(prompt_width, prompts, "prompt")
    r = _width(response_width, responses, "response")
    prompt_t = torch.full((b, p), pad_token_id, dtype=torch.long)
    prompt_attn = torch.zeros((b, p), dtype=torch.long)
    response_t = torch.full((b, r), pad_token_id, dtype=torch.long)
    response_attn = torch.zeros((b, r), dtype=torch.long)
    field_t = {name: torch.zeros((b, r), dtype=dtype) for name, (_, dtype) in fields.items()}
    for i in range(b):
        if n := len(prompts[i]):
            prompt_t[i, p - n :] = _row(prompts[i], torch.long)
            prompt_attn[i, p - n :] = 1
        if n := len(responses[i]):
            response_t[i, :n] = _row(responses[i], torch.long)
            response_attn[i, :n] = 1
            for name, (rows, dtype) in fields.items():
                field_t[name][i, :n] = _row(rows[i], dtype)
    return _assemble(prompt_t, prompt_attn, response_t, response_attn, field_t)


def repad_rollout_layout(
    tensors: Mapping[str, torch.Tensor], *, pad_token_id: int, prompt_width: int, response_width: int
) -> dict[str, torch.Tensor]:
    """An already padded layout widened to ``prompt_width``/``response_width`` (same conventions).

    Prompts gain left padding, responses and every response-aligned [B, R] key right padding
    (0 outside ``responses``); [B] keys are kept; ``input_ids``/``attention_mask``/
    ``position_ids`` are rebuilt. Other shapes are refused.
    """
    plen, rlen = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    if prompt_width < plen or response_width < rlen:
        raise ValueError(f"cannot narrow a [{plen}+{rlen}] layout to [{prompt_width}+{response_width}]")
    attn = tensors["attention_mask"]
    fields = {}
    for k, v in tensors.items():
        if k in LAYOUT_KEYS:
            continue
        if k in TOKEN_FIELDS:
            fields[k] = torch.cat([_pad_to(v[:, :plen], prompt_width, -1, left=True),
                                   _pad_to(v[:, plen:], response_width, -1, left=False)], dim=1)
        elif v.dim() == 2 and v.shape[1] == rlen:
            fields[k] = _pad_to(v, response_width, 0, left=False)
        elif v.dim() == 1:
            fields[k] = v
        else:
            raise ValueError(f"cannot re-pad batch key {k!r} of shape {tuple(v.shape)}")
    return _assemble(
        _pad_to(tensors["prompts"], prompt_width, pad_token_id, left=True),
        _pad_to(attn[:, :plen], prompt_width, 0, left=True),
        _pad_to(tensors["responses"], response_width, pad_token_id, left=False),
        _pad_to(attn[:, plen:], response_width, 0, left=False),
        fields,
    )


def concat_rollouts(batches: Sequence[Batch], pad_token_id: int) -> Batch:
    """Rows of rollout batches with different padded widths, in order, re-padded to the widest."""
    batches = [b for b in batches if len(b)]
    if not batches:
        raise ValueError("no rows to concatenate")
    p = max(b["prompts"].shape[1] for b in batches)
    r = max(b["responses"].shape[1] for b in batches)
    same = [
        Batch(repad_rollout_layout(b.tensors, pad_token_id=pad_token_id, prompt_width=p, response_width=r),
              meta=b.meta, info=b.info)
        for b in batches
    ]
    return Batch.concat(same)


def _assemble(
    prompts: torch.Tensor,
    prompt_attn: torch.Tensor,
    responses: torch.Tensor,
    response_attn: torch.Tensor,
    fields: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        **fields,
    }


def _width(given: int | None, rows: Sequence[Row], what: str) -> int:
    longest = max((len(row) for row in rows), default=0)
    if given is None:
        return max(1, longest)
    if given < longest:
        raise ValueError(f"{what} width {given} is shorter than the longest {what} ({longest} tokens)")
    return given


def _pad_to(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    pad = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def _row(values: Row, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of one row; lists of int64/float32 go through ``array`` (7x faster than
    ``torch.tensor`` on long lists, which converts element by element)."""
    if isinstance(values, torch.Tensor):
        return values
    typecode = _TYPECODES.get(dtype)
    if typecode is None:
        return torch.tensor(list(values), dtype=dtype)
    data = array.array(typecode, values)
    return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
