"""Move parameters, gradient buffers and optimizer state off the device and back (colocated mode).

The trick verl and slime use on GPU, made device-generic: copy each tensor
*storage* (the bytes under a parameter, a DDP grad buffer, an Adam moment) to a
CPU buffer (pinned when the source is on CUDA), then shrink the original storage
to 0 bytes. Every view into it (Megatron DDP's ``param.data``/``main_grad`` views
into its contiguous buffers, distributed-optimizer shards) stays the same Python
object with the same shape, so nothing has to be re-wired; reload grows the
storage back and copies the bytes in, bit for bit. On a CPU-only machine the
"device" is the CPU too: the copy is a separate allocation and the original is
really freed, so the code path (and its test) is the one used on GPU.

Do not touch offloaded tensors: their storage is empty until :meth:`reload`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    copy: torch.Tensor  # uint8 [nbytes] on the offload device


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


@dataclass
class Offloader:
    """Named groups of storages that are moved off the device together and back.

    A storage belongs to at most one group (the first that offloads it): a
    distributed-optimizer shard that is a view of a parameter moves with the
    parameters.
    """

    offload_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: dict[str, list[_Saved]] = field(default_factory=dict)
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
        saved: list[_Saved] = []
        moved = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            nbytes = storage.nbytes()
            if key in self._held or key in keep or nbytes == 0:
                continue
            pin = storage.device.type == "cuda"
            copy = torch.empty(nbytes, dtype=torch.uint8, device=self.offload_device, pin_memory=pin)
            copy.copy_(_bytes_view(storage, nbytes), non_blocking=pin)
            saved.append(_Saved(storage, nbytes, copy))
            self._held.add(key)
            moved += nbytes
        if any(s.storage.device.type == "cuda" for s in saved):
            torch.cuda.synchronize()  # the async copies must land before the storage is freed
        for s in saved:
            s.storage.resize_(0)
        self._groups[group] = saved
        return moved

    def reload(self, group: str) -> int:
        """Grow the group's storages back and copy the bytes in; returns the bytes moved."""
        saved = self._groups.pop(group, None)
        if saved is None:
            raise RuntimeError(f"offload group {group!r} is not offloaded")
        moved = 0
        for s in saved:
            s.storage.resize_(s.nbytes)
            _bytes_view(s.storage, s.nbytes).copy_(s.copy, non_blocking=s.copy.is_pinned())
            self._held.discard(s.storage._cdata)
            moved += s.nbytes
        if any(s.storage.device.type == "cuda" for s in saved):
            torch.cuda.synchronize()
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


__all__ = ["Offloader", "model_grad_tensors", "model_param_tensors", "optimizer_tensors"]
