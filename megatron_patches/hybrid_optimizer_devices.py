"""Patch ``hybrid_optimizer_devices``: megatron-core's CPU-offloaded optimizer runs when the model is on the host.

Targets: ``megatron.core.optimizer.cpu_offloading.hybrid_optimizer`` (module-global ``torch`` rebound to the CPU view
of ``_cpu_torch``: its copy streams and events are inert, its pinned host buffers unpinned), and two methods of its
``HybridDeviceOptimizer``:

* ``_get_sub_optimizer_param_groups`` splits the optimizer's parameters by ``param.is_cuda``: device parameters, up
  to ``offload_fraction`` of them, get a host copy (``.cpu().pin_memory()``) stepped by a host optimizer; the rest
  stay with a device optimizer. On a CPU run every tensor is a host tensor, so no copy is made and the first step's
  gradient hand-over looks up copies that do not exist (``KeyError``). While the split runs, the optimizer's own
  parameters count as device tensors and every tensor made from a host copy (``.cpu()``, ``.pin_memory()``, then
  ``detach``/``clone``/``float``) as a host tensor, so the split (which parameters get host copies and fp32 masters,
  which optimizer steps which) is a GPU run's exactly. Made tensors are kept until the split returns, so no ``id``
  is reused while it is read.
* ``_move_new_state_to_right_device`` (after a checkpoint load) moves the device optimizer's state ``.to("cuda")``:
  on CPU it stays on the host.

Reason: CUDA hard-coded (``is_cuda``, ``torch.cuda`` streams, ``pin_memory``, ``"cuda"``); on CPU the same code runs
with host tensors on both sides of the split, which is what the CPU tests check (the offloaded update equals the
device one; checkpoints and resume). No numerical change. ``cpu_only``: never applied where CUDA is available.

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when the hybrid optimizer takes a device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch, tensor_methods, within

MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
_TO_HOST = ("cpu", "pin_memory")
_KEEPS_SIDE = ("detach", "clone", "float")


@contextlib.contextmanager
def host_copies_marked() -> Iterator[None]:
    """Within the block, ``is_cuda`` is true except for host copies: tensors made by ``.cpu()``/``.pin_memory()``
    (``pin_memory`` returns the tensor itself: there is no device to pin for) and what ``detach``/``clone``/``float``
    make from them. Single-threaded set-up code only (the optimizer's constructor and its load hook)."""
    host: set[int] = set()
    made: list[torch.Tensor] = []  # alive until the block ends: no id is reused while it is read

    def to_host(name: str) -> Any:
        real = getattr(torch._C.TensorBase, name)

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = self if name == "pin_memory" else real(self, *args, **kwargs)
            made.append(out)
            host.add(id(out))
            return out

        return method

    def keeps_side(name: str) -> Any:
        real = torch.Tensor.__dict__.get(name) or getattr(torch._C.TensorBase, name)

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = real(self, *args, **kwargs)
            if id(self) in host:
                made.append(out)
                host.add(id(out))
            return out

        return method

    methods: dict[str, Any] = {name: to_host(name) for name in _TO_HOST}
    methods.update({name: keeps_side(name) for name in _KEEPS_SIDE})
    methods["is_cuda"] = property(lambda self: id(self) not in host)
    with tensor_methods(methods):
        yield


@contextlib.contextmanager
def device_moves_stay_on_host() -> Iterator[None]:
    """Within the block, ``tensor.to("cuda")`` (any CUDA device as the first argument) keeps the tensor on the host."""
    real = torch._C.TensorBase.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], (str, torch.device)) and torch.device(args[0]).type == "cuda":
            args = ("cpu", *args[1:])
        return real(self, *args, **kwargs)

    with tensor_methods({"to": to}):
        yield


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, (MODULE,))
    cls = ctx.attr(MODULE, "HybridDeviceOptimizer")
    if cls is not None:
        ctx.wrap(cls, "_get_sub_optimizer_param_groups", within(host_copies_marked))
        ctx.wrap(cls, "_move_new_state_to_right_device", within(device_moves_stay_on_host))


PATCH = Patch(
    name="hybrid_optimizer_devices",
    reason="the CPU-offloaded optimizer splits parameters by is_cuda and copies on CUDA streams",
    install=_install,
)
