"""Move parameters, gradient buffers and optimizer state off the device and back (colocated mode).

The trick verl and slime use on GPU, made device-generic: copy each tensor
*storage* (the bytes under a parameter, a DDP grad buffer, an Adam moment) to a
host buffer, then shrink the original storage
to 0 bytes. Every view into it (Megatron DDP's ``param.data``/``main_grad`` views
into its contiguous buffers, distributed-optimizer shards) stays the same Python
object with the same shape, so nothing has to be re-wired; reload grows the
storage back and copies the bytes in, bit for bit. On a CPU-only machine the
"device" is the CPU too: the copy is a separate allocation and the original is
really freed, so the code path (and its test) is the one used on GPU.

Host memory for copies of CUDA storages is page-locked (pinned: copies at full PCIe speed) up to a
bound, :class:`PinnedPool` (one per process, shared by every offloader: ``actor.offload_pinned_mb``):
fixed-size pinned chunks allocated once and reused by every offload; bytes past the bound go to ordinary
pageable memory, freed at reload. (torch's pinned allocator would round each copy up to a power of two
and cache it for ever: hundreds of GB per node on a large model.) After an offload frees CUDA storages,
torch's cached blocks go back to the driver (``torch.cuda.empty_cache``), where the rollout engine can
take them.

Do not touch offloaded tensors: their storage is empty until :meth:`Offloader.reload`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""Size of one pinned chunk: a power of two, which torch's pinned allocator does not round up."""


def _pinned_empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Page-locked host memory for offload copies: at most ``limit_bytes`` of it, in chunks of ``chunk_bytes``.

    Chunks are allocated while the limit allows, lent to an offloaded group and given back at its reload;
    they stay allocated for the next offload. What a process pins is therefore at most the limit (rounded
    down to whole chunks), however often and whatever it offloads. ``allocate(nbytes)`` makes one chunk
    (pinned ``uint8``; tests pass a pageable one).
    """

    def __init__(
        self, limit_bytes: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        allocate: Callable[[int], torch.Tensor] = _pinned_empty,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"PinnedPool chunk_bytes must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.limit_bytes = 0
        self._allocate = allocate
        self._free: list[torch.Tensor] = []
        self.chunks = 0
        """Chunks allocated (free or lent)."""
        self.set_limit(limit_bytes)

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes the pool holds (free or lent)."""
        return self.chunks * self.chunk_bytes

    def set_limit(self, limit_bytes: int) -> None:
        """Bound the pool at ``limit_bytes`` (0: never pin); free chunks past it are released."""
        if limit_bytes < 0:
            raise ValueError(f"PinnedPool limit must be >= 0 bytes, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self._trim()

    def take(self, nbytes: int) -> list[torch.Tensor]:
        """Chunks covering ``nbytes``; fewer (or none) where the limit is reached."""
        want = -(-nbytes // self.chunk_bytes)
        out: list[torch.Tensor] = []
        while len(out) < want and self._free:
            out.append(self._free.pop())
        while len(out) < want and self.pinned_bytes + self.chunk_bytes <= self.limit_bytes:
            out.append(self._allocate(self.chunk_bytes))
            self.chunks += 1
        return out

    def give_back(self, chunks: list[torch.Tensor]) -> None:
        """Chunks from :meth:`take`, no longer read or written (their copies have completed)."""
        self._free.extend(chunks)
        self._trim()

    def _trim(self) -> None:
        while self._free and self.pinned_bytes > self.limit_bytes:
            self._free.pop()
            self.chunks -= 1


_POOL: PinnedPool | None = None


def pinned_pool() -> PinnedPool:
    """This process's pool, bounded by ``actor.offload_pinned_mb`` (its default until the trainer sets it)."""
    global _POOL
    if _POOL is None:
        from mcore_agentic.workers.config import ActorConfig

        _POOL = PinnedPool(ActorConfig.offload_pinned_mb * 2**20)
    return _POOL


def _from_cuda(storage: torch.UntypedStorage) -> bool:
    return storage.device.type == "cuda"


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    pieces: list[tuple[int, torch.Tensor, bool]]
    """``(offset, copy, pinned)``: the storage's bytes from ``offset`` on, as uint8 host tensors."""


@dataclass
class _Group:
    saved: list[_Saved]
    pool: PinnedPool
    chunks: list[torch.Tensor]
    """Pinned chunks lent by ``pool``, given back at reload."""


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class _ChunkCursor:
    """Consecutive byte ranges of a list of chunks, handed out in order."""

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.chunks = chunks
        self.index = 0
        self.pos = 0

    def views(self, nbytes: int) -> list[torch.Tensor]:
        """Views covering up to ``nbytes`` bytes (fewer once the chunks are used up)."""
        out: list[torch.Tensor] = []
        while nbytes > 0 and self.index < len(self.chunks):
            chunk = self.chunks[self.index]
            k = min(chunk.numel() - self.pos, nbytes)
            out.append(chunk[self.pos : self.pos + k])
            self.pos += k
            nbytes -= k
            if self.pos == chunk.numel():
                self.index, self.pos = self.index + 1, 0
        return out


@dataclass
class Offloader:
    """Named groups of storages that are moved off the device together and back.

    A storage belongs to at most one group (the first that offloads it): a
    distributed-optimizer shard that is a view of a parameter moves with the
    parameters. Copies of the storages ``pin_if`` accepts (CUDA ones) go into pinned chunks of ``pool``
    while it has room, the rest into pageable memory.
    """

    offload_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pool: PinnedPool | None = None
    """Where pinned memory comes from; None: this process's :func:`pinned_pool`."""
    pin_if: Callable[[torch.UntypedStorage], bool] = _from_cuda
    """Which storages' copies are pinned (CUDA ones: pinned memory only speeds device copies)."""
    _groups: dict[str, _Group] = field(default_factory=dict)
    _held: set[int] = field(default_factory=set)

    def is_offloaded(self, group: str) -> bool:
        return group in self._groups

    def offload(self, group: str, tensors: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
        """Copy the storages under ``tensors`` out and free them; returns the bytes moved.

        Storages shared with ``exclude`` stay (e.g. fp32 optimizer "main params" that are views
        of the model's parameters, when the optimizer is offloaded but the parameters are not).
        """
        if group in self._groups:
            raise RuntimeError(f"offload group {group!r} is already offloaded; reload it first")
        keep = {t.untyped_storage()._cdata for t in exclude}
        storages: list[tuple[torch.UntypedStorage, int]] = []
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            nbytes = storage.nbytes()
            if key in self._held or key in keep or nbytes == 0:
                continue
            self._held.add(key)
            storages.append((storage, nbytes))
        pool = self.pool if self.pool is not None else pinned_pool()
        pinned_bytes = sum(n for s, n in storages if self.pin_if(s))
        chunks = pool.take(pinned_bytes) if pinned_bytes else []
        cursor = _ChunkCursor(chunks)
        saved: list[_Saved] = []
        on_cuda = any(s.device.type == "cuda" for s, _ in storages)
        try:
            for storage, nbytes in storages:
                src = _bytes_view(storage, nbytes)
                pieces: list[tuple[int, torch.Tensor, bool]] = []
                offset = 0
                if self.pin_if(storage):
                    for view in cursor.views(nbytes):
                        view.copy_(src[offset : offset + view.numel()], non_blocking=True)
                        pieces.append((offset, view, True))
                        offset += view.numel()
                if offset < nbytes:  # past the pool's bound, or not pinned at all: pageable memory
                    rest = torch.empty(nbytes - offset, dtype=torch.uint8, device=self.offload_device)
                    rest.copy_(src[offset:])
                    pieces.append((offset, rest, False))
                saved.append(_Saved(storage, nbytes, pieces))
            if on_cuda:
                torch.cuda.synchronize()  # the async copies must land before the storage is freed
        except BaseException:  # nothing was freed: the group is not offloaded
            self._held.difference_update(s._cdata for s, _ in storages)
            pool.give_back(chunks)
            raise
        for s in saved:
            s.storage.resize_(0)
        if on_cuda:
            torch.cuda.empty_cache()  # the freed blocks back to the driver, for the rollout engine
        self._groups[group] = _Group(saved, pool, chunks)
        return sum(s.nbytes for s in saved)

    def reload(self, group: str) -> int:
        """Grow the group's storages back and copy the bytes in; returns the bytes moved."""
        entry = self._groups.pop(group, None)
        if entry is None:
            raise RuntimeError(f"offload group {group!r} is not offloaded")
        moved = 0
        for s in entry.saved:
            s.storage.resize_(s.nbytes)
            dst = _bytes_view(s.storage, s.nbytes)
            for offset, copy, pinned in s.pieces:
                dst[offset : offset + copy.numel()].copy_(copy, non_blocking=pinned)
            self._held.discard(s.storage._cdata)
            moved += s.nbytes
        if any(s.storage.device.type == "cuda" for s in entry.saved):
            torch.cuda.synchronize()  # the chunks are reused: their copies must have landed
        entry.pool.give_back(entry.chunks)
        return moved


def model_param_tensors(model_chunks: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Parameters and buffers of the chunks, plus Megatron DDP's contiguous param buffers."""
    out: list[torch.Tensor] = []
    for chunk in model_chunks:
        out.extend(p.data for p in chunk.parameters())
        out.extend(b for _, b in chunk.named_buffers())
        for buf in _ddp_buffers(chunk):
            if getattr(buf, "param_data", None) is not None:
                out.append(buf.param_data)
    return out


def model_grad_tensors(model_chunks: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Megatron DDP's contiguous gradient buffers (``main_grad`` views) and any plain ``.grad``."""
    out: list[torch.Tensor] = []
    for chunk in model_chunks:
        for buf in _ddp_buffers(chunk):
            if getattr(buf, "grad_data", None) is not None:
                out.append(buf.grad_data)
        out.extend(p.grad for p in chunk.parameters() if p.grad is not None)
    return out


def optimizer_tensors(optimizer: object) -> list[torch.Tensor]:
    """Every tensor the optimizer owns: Adam moments and fp32 main params (Megatron or torch optimizer)."""
    out: list[torch.Tensor] = []
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            out.extend(p.data for p in group["params"])
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _ddp_buffers(chunk: torch.nn.Module) -> list:
    # Megatron DDP keeps its _ParamAndGradBuffer objects in the instance attributes ``buffers``
    # (shadowing nn.Module.buffers()) and ``expert_parallel_buffers``; read the instance dict.
    out: list = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = chunk.__dict__.get(name)
        if isinstance(value, list):
            out.extend(value)
    return out


def _torch_optimizers(optimizer: object) -> list[torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in _torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return _torch_optimizers(inner) if inner is not None else []


__all__ = ["Offloader", "PinnedPool", "model_grad_tensors", "model_param_tensors", "optimizer_tensors", "pinned_pool"]
