"""Streaming export of a Megatron model's shards as full engine-layout (Hugging Face) tensors, in buckets.

Every rank of the model iterates the same :class:`ExportPlan` — one entry per global
parameter (global name, full shape, dtype, owning pipeline stage), built once by
all-gathering each stage's metadata over the PP group and cached — so the collectives
of all ranks line up. Per bucket of consecutive plan entries:

1. on the owning stage the TP shards are all-gathered and merged with the bridge's
   :meth:`~mcore_agentic.models.bridge.Bridge.merge_tp` (fused gate/up handled there); an
   expert of a mixture-of-experts model is broadcast there from the expert-parallel rank
   that holds it;
2. the full tensors are broadcast from the owning stage over the PP group;
3. :meth:`~mcore_agentic.models.bridge.Bridge.megatron_param_to_hf` maps each to HF
   ``(name, tensor)`` pairs (QKV split per query group, gate/up split, vocabulary padding
   removed, the tied output layer skipped).

Two collectives per split tensor. A flat variant (one gather and one broadcast per bucket) was
measured on CPU/gloo (``bench/weight_sync.py``, 246M params, TP=2) slower at 16/64/256 MiB
buckets and was removed.

Memory. The bucket is yielded as a list that the exporter *empties* when the next bucket
is requested (a ``for bucket in ...`` loop variable would otherwise keep the previous
bucket alive while the next is built): copy out what you keep. With ``S`` the bucket
budget in bytes and ``T`` the largest full tensor, the exporter holds at most
``max(S, T) + T`` bytes at any moment: per-tensor mode fills a bucket with up to ``S`` of
full tensors and needs one gather buffer and one merged/converted copy of the current
tensor on top. Pass a
:class:`LiveBytes` to measure it. One caveat, seen on gloo: the process group's worker
thread may keep the previous collective's buffer referenced until it runs the next one
(``LiveBytes`` sees this, since the tensor's Python object lives as long as C++ holds it).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.models.bridge import Bridge, unwrap_model
from mcore_agentic.parallel import comm

HFBucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class PlanEntry:
    """One global Megatron parameter as every rank sees it."""

    name: str
    """Global Megatron name (layer index made global)."""
    full_shape: tuple[int, ...]
    """Shape with the TP shards merged (vocabulary still padded)."""
    dtype: str
    """``torch`` dtype name, e.g. ``float32``."""
    owner: int
    """Rank in the PP group of the stage holding the parameter."""
    tp_split_dim: int | None
    """Dim the TP shards split (None: replicated over TP)."""
    ep_owner: int | None = None
    """An expert's rank in the expert-parallel group that holds it (None: every EP rank holds the parameter)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.full_shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class ExportPlan:
    """The agreed export order (skipped parameters already removed) and this rank's coordinates."""

    entries: tuple[PlanEntry, ...]
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def largest_nbytes(self) -> int:
        return max((e.nbytes for e in self.entries), default=0)

class LiveBytes:
    """Running count of the bytes held by tracked tensors, and its maximum.

    Bytes are counted per storage (views of one buffer count once) from the first tracked
    tensor on it until the last tracked tensor on it is garbage (a ``weakref.finalize`` per
    tensor). Every tensor the exporter allocates or receives from the bridge is tracked.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, tracked tensors alive]

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return tensor
        key = storage.data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [nbytes, 0]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)
        return tensor

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.live -= entry[0]

def _rank_size(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def build_export_plan(bridge: Bridge, chunks: list[Any]) -> ExportPlan:
    """The export order agreed over the PP group (collective over PP: every stage must call)."""
    model = unwrap_model(chunks[0])
    tp_rank, tp_size = _rank_size(model.tp_group)
    pp_rank, pp_size = _rank_size(model.pp_group)
    ep_group = bridge.expert_group(chunks)
    ep_rank, ep_size = _rank_size(ep_group)
    meta = {}
    for name, param in bridge.local_params(chunks).items():
        dim = bridge.tp_split_dim(name)
        shape = list(param.shape)
        if dim is not None:
            shape[dim] *= tp_size
        meta[name] = (tuple(shape), str(param.dtype).removeprefix("torch."), dim, ep_rank if bridge.is_expert(name) else None)
    if ep_size > 1:  # each EP rank lists its own experts: merge the lists within the stage
        per_ep = comm.all_gather_object(meta, group=ep_group)
        meta = {name: m for part in per_ep for name, m in part.items()}
    per_stage: list[Any] = [meta]
    if pp_size > 1:
        per_stage = comm.all_gather_object(meta, group=model.pp_group)
    owner: dict[str, int] = {}
    for stage, stage_meta in enumerate(per_stage):
        for name in stage_meta:
            owner.setdefault(name, stage)  # a tied copy on a later stage is skipped below
    entries = []
    for name in sorted(owner, key=bridge.export_order_key):
        if bridge.skip_on_export(name):
            continue
        shape, dtype, dim, ep_owner = per_stage[owner[name]][name]
        entries.append(PlanEntry(name, shape, dtype, owner[name], dim, ep_owner))
    return ExportPlan(tuple(entries), tp_rank, tp_size, pp_rank, pp_size, ep_rank, ep_size)


class StreamingExporter:
    """Yields the model's HF tensors bucket by bucket, identically on every rank of the model.

    ``chunks``: this rank's model chunk(s) (DDP/Float16Module wrappers are fine). Every rank
    must iterate :meth:`buckets` to the end (it runs collectives over TP and PP).
    """

    def __init__(
        self,
        bridge: Bridge,
        chunks: list[Any],
        *,
        bucket_bytes: int,
        tracker: LiveBytes | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.bridge = bridge
        self.chunks = chunks
        self.bucket_bytes = bucket_bytes
        self.tracker = tracker
        model = unwrap_model(chunks[0])
        self._tp_group, self._pp_group = model.tp_group, model.pp_group
        self._ep_group = bridge.expert_group(chunks)
        self._plan: ExportPlan | None = None

    @property
    def plan(self) -> ExportPlan:
        """Built on first use (a PP collective), then cached: the model's structure does not change."""
        if self._plan is None:
            self._plan = build_export_plan(self.bridge, self.chunks)
        return self._plan

    def bucket_plan(self) -> list[list[PlanEntry]]:
        """Consecutive plan entries grouped so each bucket's full tensors fit the payload budget."""
        payload = self.bucket_bytes
        buckets: list[list[PlanEntry]] = []
        current: list[PlanEntry] = []
        size = 0
        for entry in self.plan.entries:
            if current and size + entry.nbytes > payload:
                buckets.append(current)
                current, size = [], 0
            current.append(entry)
            size += entry.nbytes
        if current:
            buckets.append(current)
        return buckets

    def buckets(self) -> Iterator[HFBucket]:
        """Each bucket's HF ``(name, tensor)`` pairs; the list is emptied when the next one is requested."""
        local = self.bridge.local_params(self.chunks)
        device = next(iter(local.values())).device
        for entries in self.bucket_plan():
            fulls = self._materialise(entries, local, device)
            out: HFBucket = []
            for entry in entries:
                # No local name may outlive this loop: it would keep a tensor of this bucket alive
                # while the next one is built.
                converted = self.bridge.megatron_param_to_hf(entry.name, fulls.pop(entry.name))
                out.extend((hf_name, self._track(tensor)) for hf_name, tensor in converted)
                del converted
            yield out
            out.clear()  # drop this bucket before building the next, whoever still holds the list

    # ------------------------------------------------------------------ collectives
    def _materialise(self, entries: list[PlanEntry], local: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
        """Full Megatron tensors of ``entries`` on this rank (TP-gathered on the owner, broadcast over PP)."""
        fulls: dict[str, torch.Tensor] = {}
        for entry in entries:
            fulls[entry.name] = self._one(entry, local, device)
        return fulls

    def _new(self, shape: tuple[int, ...] | int, dtype: torch.dtype, device) -> torch.Tensor:
        return self._track(comm.device_empty(*((shape,) if isinstance(shape, int) else shape), dtype=dtype, device=device))

    def _track(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.tracker.track(tensor) if self.tracker is not None else tensor

    def _is_split(self, entry: PlanEntry) -> bool:
        return entry.tp_split_dim is not None and self.plan.tp_size > 1

    def _all_gather_shards(self, local_flat: torch.Tensor) -> list[torch.Tensor]:
        """All-gather a flattened shard over TP into one buffer; returns each rank's part (views)."""
        tp = self.plan.tp_size
        gathered = self._new(tp * local_flat.numel(), local_flat.dtype, local_flat.device)
        parts = [comm.as_device(p) for p in gathered.chunk(tp)]  # views of one device buffer
        comm.all_gather_device(parts, local_flat, group=self._tp_group)
        return [self._track(p) for p in parts]

    def _merge(self, entry: PlanEntry, parts: list[torch.Tensor], shard_shape: torch.Size) -> torch.Tensor:
        shards = [self._track(p.view(shard_shape)) for p in parts]
        return self._track(self.bridge.merge_tp(entry.name, shards))

    def _broadcast(self, tensor: torch.Tensor, owner: int) -> None:
        if self.plan.pp_size > 1:
            comm.broadcast_device(tensor, group=self._pp_group, group_src=owner)

    def _one(self, entry: PlanEntry, local: dict[str, torch.Tensor], device) -> torch.Tensor:
        """Per-tensor path: one TP all-gather (split tensors), an expert's broadcast from its EP rank, one PP broadcast."""
        expert_elsewhere = entry.ep_owner is not None and entry.ep_owner != self.plan.ep_rank
        if entry.owner == self.plan.pp_rank and expert_elsewhere:
            full = self._new(entry.full_shape, entry.torch_dtype, device)
        elif entry.owner == self.plan.pp_rank:
            shard = local[entry.name].detach()
            if self._is_split(entry):
                parts = self._all_gather_shards(shard.reshape(-1).contiguous())
                full = self._merge(entry, parts, shard.shape)
                del parts
            else:
                full = self._track(shard.clone())
        else:
            full = self._new(entry.full_shape, entry.torch_dtype, device)
        if entry.owner == self.plan.pp_rank and entry.ep_owner is not None and self.plan.ep_size > 1:
            comm.broadcast_device(full, group=self._ep_group, group_src=entry.ep_owner)
        self._broadcast(full, entry.owner)
        return full


__all__ = ["ExportPlan", "HFBucket", "LiveBytes", "PlanEntry", "StreamingExporter", "build_export_plan"]
