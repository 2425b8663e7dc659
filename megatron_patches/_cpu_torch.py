"""A CPU stand-in for the ``torch`` name inside selected megatron-core modules.

Many megatron-core functions allocate with ``device=torch.cuda.current_device()``
or a literal ``device="cuda"``, call ``torch.cuda.synchronize()`` or open CUDA
streams. Copying those functions to change one argument would tie us to one
megatron-core version, so the patches instead rebind the module-global name
``torch`` of the affected megatron modules to :data:`CPU_TORCH`: an object that
forwards every attribute to the real ``torch`` except

* ``torch.cuda``: :class:`CpuCudaNamespace` — ``current_device()`` is the CPU
  device, ``synchronize``/``empty_cache`` do nothing, streams are inert, the RNG
  functions act on the CPU generator; everything else falls through to the real
  ``torch.cuda``;
* tensor factories (``torch.zeros``, ``torch.tensor``, ...): a ``device`` that
  names CUDA becomes ``"cpu"`` and ``pin_memory`` is dropped.

Only the module's global name changes; the real ``torch`` module, other
libraries and our own code are untouched. Tensor *methods* (``t.cuda()``) are
not covered: those call sites get their own small patches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

_CPU = torch.device("cpu")

# Factories whose ``device=`` keyword we redirect. Everything else is forwarded unchanged.
_FACTORIES = frozenset(
    {
        "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "eye", "rand", "randn",
        "randint", "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "empty_strided",
    }
)


def _names_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # A bare int is a CUDA ordinal in torch's factory API.
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_factory(fn: Any) -> Any:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return factory


class _InertStream:
    """Stands in for ``torch.cuda.Stream``/``Event`` on CPU, where all work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _InertStream:
        return _InertStream()

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuCudaNamespace:
    """``torch.cuda`` as seen by a patched megatron module when the process runs on CPU."""

    Stream = _InertStream
    Event = _InertStream

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def stream(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _InertStream:
        return _InertStream()

    default_stream = current_stream

    # RNG: on CPU the "device" generator is the CPU default generator.
    @staticmethod
    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class CpuTorch:
    """Forwards to the real ``torch`` module except for ``cuda`` and the tensor factories."""

    cuda = CpuCudaNamespace()

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        value = getattr(torch, name)
        if name in _FACTORIES:
            value = _cpu_factory(value)
        # torch's top-level names are fixed after import; caching keeps hot-path lookups (torch.matmul in the
        # TP layers) to one dict hit instead of a __getattr__ round trip.
        self._cache[name] = value
        return value

    def __repr__(self) -> str:
        return "<megatron_patches CPU view of torch>"


CPU_TORCH = CpuTorch()


def rebind_torch(ctx: Any, module_names: tuple[str, ...]) -> list[str]:
    """Point the ``torch`` global of each importable module in ``module_names`` at :data:`CPU_TORCH`.

    Returns the modules actually patched (others are missing in this version and skipped).
    """
    done = []
    for dotted in module_names:
        mod = ctx.module(dotted)
        if mod is not None and getattr(mod, "torch", None) is torch and ctx.swap(mod, "torch", CPU_TORCH):
            done.append(dotted)
    return done


@contextlib.contextmanager
def tensor_methods(replacements: dict[str, Any]) -> Iterator[None]:
    """Within the block, ``torch.Tensor.<name>`` is ``replacements[name]`` (a method or a property); whatever was
    there before comes back after it (nesting-safe). For single-threaded setup and checkpoint code only, never
    around the training step: the real ``torch.Tensor`` changes for every caller while the block runs."""
    missing = object()
    previous = {name: torch.Tensor.__dict__.get(name, missing) for name in replacements}
    for name, value in replacements.items():
        setattr(torch.Tensor, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is missing:
                delattr(torch.Tensor, name)  # falls back to TensorBase's
            else:
                setattr(torch.Tensor, name, value)


def within(context: Any) -> Any:
    """A decorator factory: ``within(context)(fn)`` runs ``fn`` inside a fresh ``context()``."""

    def make(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with context():
                return fn(*args, **kwargs)

        return wrapped

    return make


def _identity(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def tensor_cuda_is_identity() -> contextlib.AbstractContextManager:
    """Within the block, ``tensor.cuda(...)`` returns the tensor itself (for megatron code that moves to CUDA)."""
    return tensor_methods({"cuda": _identity})


with_tensor_cuda_identity = within(tensor_cuda_is_identity)
"""``fn`` wrapped so that ``.cuda()`` calls inside it keep tensors on the CPU."""


def wrap_cuda_calls(ctx: Any, targets: tuple[tuple[str, str, str | None], ...]) -> None:
    """Wrap each ``(module, class or None, function)`` with :func:`with_tensor_cuda_identity` (skip if absent)."""
    for dotted, cls_name, fn_name in targets:
        mod = ctx.module(dotted)
        owner = mod if cls_name is None or mod is None else getattr(mod, cls_name, None)
        if owner is not None and hasattr(owner, fn_name):
            ctx.swap(owner, fn_name, with_tensor_cuda_identity(getattr(owner, fn_name)))
