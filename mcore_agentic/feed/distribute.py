"""Rows go where they are trained: the step's plan and the one tensor exchange that carries it out.

After scoring, each rollout leader holds its rollout group's rows (tensors and per-row Python
objects: messages, tool I/O, request metrics). The objects stay there; only tensors move:

1. :func:`gather_shapes` — one ``all_gather`` of a ``[rows, 2]`` integer tensor (each row's prompt and
   response length; a rollout group may hold fewer rows than another under dynamic sampling, and
   pads): every rank then knows every row's size.
2. :func:`plan_step` — the same pure function on every rank: a seeded shuffle of the step's rows,
   cut into chunks (the actor's and critic's mini-batches are whole numbers of chunks), each
   chunk dealt over the DP replicas with equal row counts and balanced token counts
   (Karmarkar–Karp, :mod:`mcore_agentic.data.balance`); the heaviest share of a chunk goes to the
   replica with the fewest tokens so far. A mini-batch is therefore the same set of rows whatever
   the DP layout.
3. :func:`exchange_rows` — each leader packs, per destination replica, its rows' real tokens and
   per-token values into one int64 and one float32 buffer and sends them point-to-point
   (``batch_isend_irecv``) to the replica's first rank, which broadcasts them over its replica
   (TP x CP x PP peers). The replica rebuilds its rows in the rollout layout, padded only to its
   own longest row. Which fields travel, in which buffer and order, is the table's (:mod:`.fields`): the
   caller names the wanted ones. A mixture-of-experts rollout's ``routed_experts`` (int16 per token, MoE
   layer and top-k slot) ride in the int64 buffer, four to a value.

A rank receives its replica's share of the step and nothing else; the bytes that cross the
wire are real tokens, not padding or pickles.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.algorithms.sequence_advantages import group_ids
from mcore_agentic.data.balance import partition
from mcore_agentic.data.batch import Batch, build_rollout_layout, build_token_field
from mcore_agentic.feed.fields import FILLER_VERSION, OWN, RowField, bare_fields, field_names, select
from mcore_agentic.parallel import comm

__all__ = ["FILLER_VERSION", "ROUTING_FIELD", "filler_rows", "gather_row_counts", "tag_episodes", "RowShapes",
           "StepPlan", "deal_rows", "exchange_rows", "gather_shapes", "pack_rows", "plan_step", "return_rows", "tag_groups",
           "unpack_rows"]

ROUTING_FIELD = "routed_experts"
"""The per-token int16 field that travels with a row when the exchange is given its per-token shape."""


@dataclass(frozen=True)
class RowShapes:
    """Every row of the step, by global id (rollout group ``g``'s rows follow those of groups ``< g``): its real
    prompt and response lengths."""

    prompt: list[int]
    response: list[int]
    group_rows: list[int]
    """Rows each rollout group holds (all equal unless dynamic sampling kept more groups in some)."""
    group_leaders: list[int]
    """Global rank holding each rollout group's rows."""

    def __post_init__(self) -> None:
        if len(self.group_rows) != len(self.group_leaders) or sum(self.group_rows) != len(self.prompt):
            raise ValueError(f"{len(self.prompt)} rows do not match rollout groups of {list(self.group_rows)} rows")
        object.__setattr__(self, "_starts", list(itertools.accumulate(self.group_rows, initial=0)))

    def tokens(self, row: int) -> int:
        return self.prompt[row] + self.response[row]

    def group(self, row: int) -> int:
        """The rollout group holding ``row``."""
        return bisect.bisect_right(self._starts, row) - 1  # type: ignore[attr-defined]

    def source(self, row: int) -> int:
        return self.group_leaders[self.group(row)]

    def local_index(self, row: int) -> int:
        """``row``'s index in its leader's batch."""
        return row - self._starts[self.group(row)]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StepPlan:
    """Which rows each DP replica trains, in its training order (mini-batch chunk by chunk)."""

    shapes: RowShapes
    replicas: list[list[int]]

    def replica_tokens(self) -> list[int]:
        return [sum(self.shapes.tokens(r) for r in rows) for rows in self.replicas]


# ----------------------------------------------------------------------------------- shapes
def tag_groups(local: Batch, first_row: int) -> Batch:
    """``local`` plus ``group_index`` [B]: a step-wide integer id of each row's prompt group (its ``uid``).

    A leader whose rows are the step's rows ``first_row ..`` numbers its prompts ``first_row + k``
    (``k`` < its row count): unique over the step, below the step's row count, no strings sent.
    """
    gid, _ = group_ids(local["uid"], len(local))
    return local.update({"group_index": gid + first_row})


def tag_episodes(local: Batch, first_row: int) -> Batch:
    """``local`` plus ``episode_index`` [B]: a step-wide integer id of each row's episode (its ``episode_id``; the
    samples of an agent episode whose session forked share it), numbered like :func:`tag_groups`; and
    ``turn_offset`` [B], the episode's turn index of each row's first turn."""
    eid, _ = group_ids(local["episode_id"], len(local))
    offsets = local.meta.get("turn_offset") or [0] * len(local)
    return local.update({"episode_index": eid + first_row, "turn_offset": torch.tensor(offsets, dtype=torch.long)})


def gather_row_counts(local: Batch | None, placement: Any) -> list[int]:
    """Rows each rollout group holds this step (one all-gather of one integer per rank): an agent episode whose
    session forked trains several samples, so a group's row count is known only after its rollout."""
    mine = comm.host_zeros(1, dtype=torch.long)
    if local is not None:
        mine[0] = len(local)
    table = comm.all_gather_host(mine)
    return [int(table[g * placement.tensor_parallel_size][0]) for g in range(placement.num_groups)]


def filler_rows(local: Batch, count: int, pad_token_id: int) -> Batch:
    """``count`` rows that train nothing, to append to ``local``: row 0's prompt with no response, a loss mask of 0,
    score 0, a prompt group and an episode of their own (so no group statistic sees them) and weight version
    :data:`FILLER_VERSION` (so no data metric counts them): each field of the table its
    :attr:`~.fields.RowField.filler`, in the tensor when ``local`` holds it, else in the ``meta`` list the hand-off
    makes it from.

    They make a step whose episodes trained several samples a multiple of the rows every mini-batch needs on every
    replica; like a failed request's row they cost only their prompt's forward pass."""
    rows = local.index([0] * count)
    p = rows["prompts"].shape[1]
    tensors: dict[str, torch.Tensor] = {"responses": torch.full_like(rows["responses"], pad_token_id)}
    attention = rows["attention_mask"].clone()
    attention[:, p:] = 0
    tensors["attention_mask"] = attention
    if "input_ids" in rows:
        ids = rows["input_ids"].clone()
        ids[:, p:] = pad_token_id
        tensors["input_ids"] = ids
    names = [f"filler-{k}-{local['uid'][0]}" for k in range(count)]
    meta: dict[str, list[Any]] = {"uid": names, "request_metrics": [{"state": "filler"}] * count}
    for f in select(field_names()):
        if isinstance(f.filler, str):  # OWN: an id numbered from its meta key later; ROW0: row 0's own values
            if f.filler == OWN and f.meta is not None and f.meta in rows.meta:
                meta[f.meta] = names
        elif f.name in rows.tensors:
            tensors[f.name] = torch.full_like(rows.tensors[f.name], f.filler)
        elif f.meta is not None and f.meta in rows.meta:
            meta[f.meta] = [f.filler] * count
    return rows.update(tensors, meta=meta)


def _real_lengths(local: Batch) -> torch.Tensor:
    p = local["prompts"].shape[1]
    attn = local["attention_mask"]
    return torch.stack([attn[:, :p].sum(1), attn[:, p:].sum(1)], dim=1).long()


def gather_shapes(local: Batch | None, placement: Any, group_rows: int | Sequence[int]) -> RowShapes:
    """Every row's prompt and response length on every rank (one all-gather of small integer tensors).

    ``group_rows``: the rows each rollout group holds (an int: the same in every group).
    """
    leaders = [g * placement.tensor_parallel_size for g in range(placement.num_groups)]
    counts = [int(group_rows)] * placement.num_groups if isinstance(group_rows, int) else [int(n) for n in group_rows]
    expected = counts[placement.group_index]
    if local is not None and len(local) != expected:
        raise ValueError(f"rollout group {placement.group_index} returned {len(local)} rows, expected {expected}")
    width = max(counts)  # the all-gather needs one size: shorter groups pad with zero rows
    mine = comm.host_zeros(width, 2, dtype=torch.long)
    if local is not None:
        mine[: len(local)] = _real_lengths(local)
    if (not dist.is_initialized() or dist.get_world_size() == 1) and local is None:
        raise ValueError("a world of one rank must have rolled out (it is its own rollout leader)")
    table = comm.all_gather_host(mine)
    rows = torch.cat([table[r][:n] for r, n in zip(leaders, counts)])
    return RowShapes(rows[:, 0].tolist(), rows[:, 1].tolist(), counts, leaders)


# ----------------------------------------------------------------------------------- plan
def deal_rows(tokens: Sequence[int], *, chunk: int, dp: int, seed: int | None) -> list[list[int]]:
    """Row ids per DP replica: a ``seed``-ed shuffle (None: in order) cut into ``chunk``-row pieces, each dealt
    with ``chunk / dp`` rows per replica and balanced tokens. Replica lists run piece by piece."""
    n = len(tokens)
    if chunk < 1 or n % chunk or chunk % dp:
        raise ValueError(f"{n} rows do not cut into chunks of {chunk} split evenly over {dp} replicas")
    if seed is None:
        order = list(range(n))
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    out: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for start in range(0, n, chunk):
        rows = order[start : start + chunk]
        shares = partition([tokens[r] for r in rows], dp, equal_size=True)  # heaviest share first
        for share, replica in zip(shares, sorted(range(dp), key=lambda d: (load[d], d))):
            out[replica] += [rows[i] for i in share]
            load[replica] += sum(tokens[rows[i]] for i in share)
    return out


def plan_step(shapes: RowShapes, dp: int, *, mini_batch_sizes: Sequence[int], seed: int | None) -> StepPlan:
    """The step's plan (identical on every rank): chunks are the largest piece every mini-batch is made of."""
    n = len(shapes.prompt)
    chunk = math.gcd(n, *[int(m) for m in mini_batch_sizes])
    tokens = [shapes.tokens(r) for r in range(n)]
    return StepPlan(shapes, deal_rows(tokens, chunk=chunk, dp=dp, seed=seed))


# ----------------------------------------------------------------------------------- exchange
def _travelling(fields: Collection[str] | None) -> tuple[tuple[RowField, ...], tuple[RowField, ...]]:
    """The table's per-response-token and per-row entries of ``fields`` (None: :func:`~.fields.bare_fields`), in
    the table's order (the buffers' order). Per-token fields travel when the exchange is given their shape."""
    chosen = select(bare_fields() if fields is None else fields)
    return tuple(f for f in chosen if f.per == "response"), tuple(f for f in chosen if f.per == "row")


def _count(fields: Sequence[RowField], dtype: torch.dtype) -> int:
    return sum(f.dtype == dtype for f in fields)


def _routing_int64s(tokens: int, routing_shape: tuple[int, ...] | None) -> int:
    """int64 values holding ``tokens`` rows of int16 routing (four to a value)."""
    return 0 if not routing_shape else -(-tokens * math.prod(routing_shape) // 4)


def _row_sizes(
    shapes: RowShapes, row: int, routing_shape: tuple[int, ...] | None,
    travel: tuple[Sequence[RowField], Sequence[RowField]],
) -> tuple[int, int]:
    """(int64 values, float32 values) one row carries: its ids, then its response and row fields (``travel``:
    :func:`_travelling`'s), then its routing."""
    response_fields, row_fields = travel
    p, r = shapes.prompt[row], shapes.response[row]
    ints = p + r + r * _count(response_fields, torch.long) + _count(row_fields, torch.long)
    ints += _routing_int64s(p + r, routing_shape)
    return ints, r * _count(response_fields, torch.float32) + _count(row_fields, torch.float32)


def _routing_as_int64(values: torch.Tensor) -> torch.Tensor:
    flat = values.reshape(-1).to(torch.int16).clone()  # its own storage: a slice may start mid-int64
    extra = -len(flat) % 4
    if extra:
        flat = torch.cat([flat, torch.full((extra,), -1, dtype=torch.int16)])
    return flat.view(torch.int64)


def _pack(
    local: Batch, rows: Sequence[int], shapes: RowShapes, routing_shape: tuple[int, ...] | None = None,
    fields: Collection[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This leader's ``rows`` (global ids) as one int64 and one float32 buffer, row after row."""
    response_fields, row_fields = _travelling(fields)
    width = local["prompts"].shape[1]
    ints: list[torch.Tensor] = []
    floats: list[torch.Tensor] = []
    for row in rows:
        i = shapes.local_index(row)
        p, r = shapes.prompt[row], shapes.response[row]
        ints += [local["prompts"][i, width - p :], local["responses"][i, :r]]
        for f in response_fields:
            (ints if f.dtype == torch.long else floats).append(local[f.name][i, :r].to(f.dtype))
        for f in row_fields:
            (ints if f.dtype == torch.long else floats).append(local[f.name][i : i + 1].to(f.dtype))
        if routing_shape:
            ints.append(_routing_as_int64(local[ROUTING_FIELD][i, width - p : width + r]))
    cat = lambda parts, dtype: torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)  # noqa: E731
    return cat(ints, torch.long), cat(floats, torch.float32)


def _unpack(
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: Sequence[int], shapes: RowShapes, pad_token_id: int,
    routing_shape: tuple[int, ...] | None = None, fields: Collection[str] | None = None,
) -> Batch:
    response_fields, row_fields = _travelling(fields)
    cursor = {src: [0, 0] for src in buffers}

    def take(src: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        k = 0 if dtype == torch.long else 1
        at = cursor[src]
        piece = buffers[src][k][at[k] : at[k] + n]
        at[k] += n
        return piece

    prompts, responses = [], []
    per_token: dict[str, list[torch.Tensor]] = {f.name: [] for f in response_fields}
    per_row: dict[str, list[torch.Tensor]] = {f.name: [] for f in row_fields}
    routing: list[torch.Tensor] = []
    for row in rows:
        src = shapes.source(row)
        p, r = shapes.prompt[row], shapes.response[row]
        prompts.append(take(src, torch.long, p))
        responses.append(take(src, torch.long, r))
        for f in response_fields:
            per_token[f.name].append(take(src, f.dtype, r))
        for f in row_fields:
            per_row[f.name].append(take(src, f.dtype, 1))
        if routing_shape:
            packed = take(src, torch.long, _routing_int64s(p + r, routing_shape)).view(torch.int16)
            routing.append(packed[: (p + r) * math.prod(routing_shape)].reshape(p + r, *routing_shape))
    tensors = build_rollout_layout(
        prompts, responses, pad_token_id=pad_token_id,
        response_fields={f.name: (per_token[f.name], f.dtype) for f in response_fields},
    )
    tensors.update({f.name: torch.cat(per_row[f.name]) if per_row[f.name] else torch.zeros(0, dtype=f.dtype)
                    for f in row_fields})
    if routing_shape and rows:
        tensors[ROUTING_FIELD] = build_token_field(
            routing, [len(t) for t in prompts],
            prompt_width=tensors["prompts"].shape[1], response_width=tensors["responses"].shape[1],
        )
    return Batch(tensors=tensors)


def pack_rows(local: Batch, fields: Collection[str], routing_shape: tuple[int, ...] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All of ``local``'s rows as the exchange packs them: ``([rows, 2]`` prompt and response lengths, the int64
    buffer, the float32 buffer) — what a rollout rank streams to the trainer under separate placement."""
    lengths = _real_lengths(local)
    shapes = RowShapes(lengths[:, 0].tolist(), lengths[:, 1].tolist(), [len(local)], [0])
    ints, floats = _pack(local, range(len(local)), shapes, routing_shape, fields)
    return lengths, ints, floats


def unpack_rows(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], pad_token_id: int,
                fields: Collection[str], routing_shape: tuple[int, ...] | None = None) -> Batch:
    """The rows of several :func:`pack_rows` results, in order, as one padded :class:`Batch`."""
    lengths = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, 2, dtype=torch.long)
    shapes = RowShapes(lengths[:, 0].tolist(), lengths[:, 1].tolist(), [len(p[0]) for p in parts],
                       list(range(len(parts))))
    buffers = {k: (p[1], p[2]) for k, p in enumerate(parts)}
    return _unpack(buffers, range(len(lengths)), shapes, pad_token_id, routing_shape, fields)


def exchange_rows(
    local: Batch | None, plan: StepPlan, layout: Any, pad_token_id: int, routing_shape: tuple[int, ...] | None = None,
    fields: Collection[str] | None = None,
) -> Batch:
    """This rank's replica's rows (``plan.replicas[layout.dp_rank]``, in that order) as a padded :class:`Batch`.

    Collective over the world: leaders send, each replica's first rank receives, then broadcasts
    to its replica. Only int64/float32 tensors move; their sizes come from ``plan.shapes``.
    ``routing_shape``: ``(moe_layers, top_k)`` when the rows carry ``routed_experts`` (every rank passes it);
    ``fields``: the names of the table's fields that travel (:mod:`.fields`; every rank passes the same; None:
    :func:`~.fields.bare_fields`).
    """
    if fields is not None and (ROUTING_FIELD in fields) != bool(routing_shape):
        raise ValueError(f"{ROUTING_FIELD} travels exactly when the exchange is given its per-token shape, "
                         f"got routing_shape={routing_shape}")
    shapes = plan.shapes
    me = dist.get_rank() if dist.is_initialized() else 0
    dp = len(plan.replicas)
    firsts = [layout.replica_ranks(d)[0] for d in range(dp)]
    mine = plan.replicas[layout.dp_rank]
    sends: list[tuple[torch.Tensor, int, int]] = []
    recvs: list[tuple[torch.Tensor, int, int]] = []
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    # Sends: a leader's rows, per destination replica, to that replica's first rank.
    if local is not None:
        for d, rows in enumerate(plan.replicas):
            own = [r for r in rows if shapes.source(r) == me]
            if not own:
                continue
            ints, floats = _pack(local, own, shapes, routing_shape, fields)
            if firsts[d] == me:
                buffers[me] = (ints, floats)
                continue
            for tag, t in enumerate((ints, floats)):  # tags: gloo pairs sends and receives by (peer, tag)
                if t.numel():
                    sends.append((comm.as_host(t), firsts[d], tag))
    # Receives: at this replica's first rank, one pair of buffers per leader that has rows here.
    sizes: dict[int, list[int]] = {}
    travel = _travelling(fields)
    for row in mine:
        n_int, n_float = _row_sizes(shapes, row, routing_shape, travel)
        acc = sizes.setdefault(shapes.source(row), [0, 0])
        acc[0] += n_int
        acc[1] += n_float
    if me == firsts[layout.dp_rank]:
        for src, (n_int, n_float) in sorted(sizes.items()):
            if src == me:
                continue
            pair = (comm.host_empty(n_int, dtype=torch.long), comm.host_empty(n_float, dtype=torch.float32))
            buffers[src] = pair
            for tag, t in enumerate(pair):
                if t.numel():
                    recvs.append((t, src, tag))
    comm.exchange_host(sends, recvs)
    # The replica's other ranks get the same rows from its first rank.
    group = layout.replica_group()
    if group is not None:
        order = sorted(sizes)
        flat_int = comm.host_empty(sum(sizes[s][0] for s in order), dtype=torch.long)
        flat_float = comm.host_empty(sum(sizes[s][1] for s in order), dtype=torch.float32)
        if me == firsts[layout.dp_rank] and order:
            flat_int = comm.as_host(torch.cat([buffers[s][0] for s in order]))
            flat_float = comm.as_host(torch.cat([buffers[s][1] for s in order]))
        for t in (flat_int, flat_float):
            if t.numel():
                comm.broadcast_host(t, src=firsts[layout.dp_rank], group=group)
        buffers, at = {}, [0, 0]
        for s in order:
            buffers[s] = (flat_int[at[0] : at[0] + sizes[s][0]], flat_float[at[1] : at[1] + sizes[s][1]])
            at[0] += sizes[s][0]
            at[1] += sizes[s][1]
    return _unpack(buffers, mine, shapes, pad_token_id, routing_shape, fields)


def return_rows(
    batch: Batch, plan: StepPlan, layout: Any, fields: Sequence[str], local_rows: int | None
) -> dict[str, list[torch.Tensor]] | None:
    """The reverse of :func:`exchange_rows` for per-response-token ``fields`` of the trained ``batch``.

    Each replica's first rank sends every leader the values of that leader's rows (one float32
    buffer per leader); a leader gets, per field, one response-length tensor per local row, in
    its rollout order. Collective over the world; None off the leaders (``local_rows`` None there,
    else the leader's row count). Used by trajectory dumps, on dump steps only.
    """
    shapes = plan.shapes
    me = dist.get_rank() if dist.is_initialized() else 0
    firsts = [layout.replica_ranks(d)[0] for d in range(len(plan.replicas))]
    sends: list[tuple[torch.Tensor, int, int]] = []
    recvs: list[tuple[torch.Tensor, int, int]] = []
    local: dict[int, torch.Tensor] = {}
    # Sends: this replica's rows, grouped by the leader they came from, row after row, field after field.
    if me == firsts[layout.dp_rank]:
        by_source: dict[int, list[torch.Tensor]] = {}
        for j, row in enumerate(plan.replicas[layout.dp_rank]):
            r = shapes.response[row]
            by_source.setdefault(shapes.source(row), []).extend(batch[f][j, :r].float().cpu() for f in fields)
        for src, parts in sorted(by_source.items()):
            buf = comm.as_host(torch.cat(parts) if parts else torch.zeros(0))
            if src == me:
                local[firsts[layout.dp_rank]] = buf
            elif buf.numel():
                sends.append((buf, src, 2))
    # Receives: at a leader, one buffer per replica that trained some of its rows.
    mine_by_replica: dict[int, list[int]] = {}
    if local_rows is not None:
        for d, rows in enumerate(plan.replicas):
            own = [r for r in rows if shapes.source(r) == me]
            if own:
                mine_by_replica[d] = own
        for d, own in mine_by_replica.items():
            if firsts[d] == me:
                continue
            buf = comm.host_empty(sum(shapes.response[r] for r in own) * len(fields), dtype=torch.float32)
            local[firsts[d]] = buf
            if buf.numel():
                recvs.append((buf, firsts[d], 2))
    comm.exchange_host(sends, recvs)
    if local_rows is None:
        return None
    out: dict[str, list[torch.Tensor | None]] = {f: [None] * local_rows for f in fields}
    for d, own in mine_by_replica.items():
        buf, at = local[firsts[d]], 0
        for row in own:
            r = shapes.response[row]
            for f in fields:
                out[f][shapes.local_index(row)] = buf[at : at + r]
                at += r
    return out  # type: ignore[return-value]
