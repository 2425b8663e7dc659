"""The communication policy: every collective on the step path says whether it moves a control value on
the host or a payload on the compute device, and goes through this module.

On CUDA the default process group is ``cpu:gloo,cuda:nccl`` (:func:`backend_for`), and every group
Megatron or this package creates inherits both backends: torch picks the backend by the tensors'
device. Two kinds of call follow from that:

* **host** (control values and host data: counts, shapes, statistics, stop flags, the step's rows,
  objects, barriers): CPU tensors over gloo. They never touch an SM, never spin while a long
  rollout keeps other ranks waiting, and time out with an exception (``trainer.dist_timeout_minutes``)
  instead of NCCL's watchdog abort.
* **device** (payloads: weights, activations, logits, per-token outputs): tensors on the compute
  device over NCCL.

Why a mixed default group rather than dedicated gloo groups: Megatron creates its groups itself
(``parallel_state``), and each one then carries both backends with no second set of groups to build
and keep in step; ``torch.distributed`` routes a CPU tensor to gloo and a CUDA tensor to NCCL on the
same group, so a host call cannot land on NCCL by accident.

Placement is tracked, not inferred: tensors this module allocates or places are tagged ``host`` or
``device``. :func:`enable_strict` (the test suite turns it on through ``MCORE_AGENTIC_STRICT_COMM=1``)
makes every raw ``torch.distributed`` collective called from this package an error, a host call take
only tensors placed on the host here, and a device call refuse host-placed tensors and receive only
into buffers allocated here on the device. On CPU both kinds are CPU tensors, so the tags are what
tells them apart: a receive buffer allocated as a plain ``torch.zeros`` for a device broadcast (the
sender's tensor being on CUDA) fails in the CPU suite, not on the first GPU run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STRICT_ENV = "MCORE_AGENTIC_STRICT_COMM"
HOST, DEVICE = "host", "device"
_TAG = "_mcore_agentic_place"

class CommPolicyError(RuntimeError):
    """A collective that bypasses the communication policy, or a tensor placed against it."""


def backend_for(device_type: str) -> str:
    """The default group's backend: ``cpu:gloo,cuda:nccl`` on CUDA (host calls on gloo, payloads on NCCL), else gloo."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def compute_device() -> torch.device:
    """Where this rank's models and payloads live: its current CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------- placement
def _tag(t: torch.Tensor, place: str) -> torch.Tensor:
    setattr(t, _TAG, place)
    return t


def place_of(t: torch.Tensor) -> str | None:
    """``host``, ``device`` or None (a tensor this module did not place)."""
    return getattr(t, _TAG, None)


def to_host(t: torch.Tensor | Sequence[Any], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of ``t`` (values, a list, or a tensor on any device) for a host call; always a new tensor."""
    if isinstance(t, torch.Tensor):
        out = t.detach().to("cpu", dtype=dtype if dtype is not None else t.dtype, copy=True)
    else:
        out = torch.tensor(t, dtype=dtype)
    return _tag(out, HOST)


def host_empty(*size: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host buffer for a host call."""
    return _tag(torch.empty(*size, dtype=dtype), HOST)


def host_zeros(*size: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host buffer for a host call."""
    return _tag(torch.zeros(*size, dtype=dtype), HOST)


def as_host(t: torch.Tensor) -> torch.Tensor:
    """Declare a host tensor built elsewhere (a packed row buffer) as host data; it must be on the CPU."""
    if t.device.type != "cpu":
        raise CommPolicyError(f"as_host: a {t.device} tensor is not host data; use to_host()")
    return _tag(t, HOST)


def device_empty(*size: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """An uninitialised receive buffer for a device call, on the compute device."""
    return _tag(torch.empty(*size, dtype=dtype, device=device or compute_device()), DEVICE)


def device_zeros(*size: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A zeroed buffer for a device call, on the compute device."""
    return _tag(torch.zeros(*size, dtype=dtype, device=device or compute_device()), DEVICE)


def as_device(t: torch.Tensor) -> torch.Tensor:
    """Declare a tensor (a model output, a weight) as device payload; on CUDA it must be on a GPU."""
    if place_of(t) == HOST:
        raise CommPolicyError("as_device: this tensor was placed on the host for a control call")
    _check_payload_device(t, "as_device")
    return _tag(t, DEVICE)


# ----------------------------------------------------------------------------- checks
_STRICT = False


def strict() -> bool:
    return _STRICT


def _check_host(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu":
        raise CommPolicyError(f"{what}: host calls take CPU tensors (gloo), got one on {t.device}; use comm.to_host()")
    if _STRICT and place_of(t) != HOST:
        raise CommPolicyError(
            f"{what}: a tensor that did not come through the host policy (comm.to_host / host_empty / as_host)"
        )


def _check_payload_device(t: torch.Tensor, what: str) -> None:
    if torch.cuda.is_available() and t.device.type != "cuda":
        raise CommPolicyError(f"{what}: device calls take tensors on the compute device, got one on {t.device}")


def _check_device(t: torch.Tensor, what: str, *, receives: bool) -> None:
    _check_payload_device(t, what)
    if not _STRICT:
        return
    if place_of(t) == HOST:
        raise CommPolicyError(f"{what}: a host-placed tensor on a device call (its peers send device tensors)")
    if receives and place_of(t) != DEVICE:
        raise CommPolicyError(
            f"{what}: a receive buffer that was not allocated on the device by the policy (comm.device_empty / "
            "device_zeros): the sender's tensor lives on the compute device"
        )


def _world(group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


# ----------------------------------------------------------------------------- host calls
def all_reduce_host(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce a host tensor in place over ``group`` (gloo); returns it. Identity on one rank."""
    _check_host(t, "all_reduce_host")
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_host(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's copy of a host tensor of one shape (gloo)."""
    _check_host(t, "all_gather_host")
    n = _world(group)
    if n == 1:
        return [t]
    out = [host_empty(*t.shape, dtype=t.dtype) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return out


def broadcast_host(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Broadcast a host tensor from global rank ``src`` over ``group`` (gloo), in place; returns it."""
    _check_host(t, "broadcast_host")
    if _world(group) > 1:
        dist.broadcast(t, src=src, group=group)
    return t


def exchange_host(sends: Sequence[tuple[torch.Tensor, int, int]], recvs: Sequence[tuple[torch.Tensor, int, int]]) -> None:
    """Point-to-point host transfers, ``(tensor, peer, tag)`` each, posted as one batch and waited for (gloo).

    gloo pairs a send with a receive by (peer, tag): give two transfers between the same peers different tags."""
    ops = []
    for t, peer, tag in sends:
        _check_host(t, "exchange_host send")
        ops.append(dist.P2POp(dist.isend, t, peer, tag=tag))
    for t, peer, tag in recvs:
        _check_host(t, "exchange_host receive")
        ops.append(dist.P2POp(dist.irecv, t, peer, tag=tag))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def send_link(t: torch.Tensor, link: Any, peer: int, tag: int) -> None:
    """Send a host tensor to ``peer`` (its rank in the link) over a link between the trainer's and the rollout's
    ranks (:mod:`.job`: a gloo group of its own, outside both sides' worlds); returns once it is sent."""
    _check_host(t, "send_link")
    link.send([t], peer, tag).wait()


def recv_link(t: torch.Tensor, link: Any, peer: int, tag: int) -> torch.Tensor:
    """Receive into a host tensor from ``peer`` over a link (:func:`send_link`); returns it."""
    _check_host(t, "recv_link")
    link.recv([t], peer, tag).wait()
    return t


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group``: a one-integer host all-reduce (gloo: no device, no NCCL watchdog)."""
    if _world(group) > 1:
        dist.all_reduce(host_zeros(1, dtype=torch.int32), group=group)


def broadcast_object(obj: Any, group: dist.ProcessGroup | None = None, group_src: int = 0) -> Any:
    """A picklable object from group rank ``group_src`` to every rank of ``group`` (host)."""
    if _world(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=group_src, device=torch.device("cpu"))
    return box[0]


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable object (host)."""
    n = _world(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


# ----------------------------------------------------------------------------- device calls
def all_reduce_device(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce a payload in place over ``group`` on the compute device (NCCL on GPUs); returns it."""
    _check_device(t, "all_reduce_device", receives=False)
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_device(
    out: list[torch.Tensor], t: torch.Tensor, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Gather a payload into ``out`` (device buffers from :func:`device_empty`) over ``group``."""
    _check_device(t, "all_gather_device", receives=False)
    for o in out:
        _check_device(o, "all_gather_device", receives=True)
    dist.all_gather(out, t, group=group)
    return out


def broadcast_device(t: torch.Tensor, group: dist.ProcessGroup, group_src: int) -> torch.Tensor:
    """Broadcast a payload from group rank ``group_src`` over ``group``, in place; other ranks receive into a
    buffer from :func:`device_empty`."""
    receives = dist.get_rank(group) != group_src
    _check_device(t, "broadcast_device", receives=receives)
    dist.broadcast(t, group=group, group_src=group_src)
    return t


def reduce_scatter_device(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``1 / world`` slice (along dim 0) of ``t`` summed over ``group``. On CUDA a reduce-scatter
    (NCCL); on CPU, where gloo has none, an all-reduce of the whole tensor and a slice (``world`` times the
    traffic, tests only). Decided by the tensor's device, not a backend name: the default group is mixed."""
    _check_device(t, "reduce_scatter_device", receives=False)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[0] % n:
        raise ValueError(f"reduce_scatter_device: dim 0 ({t.shape[0]}) must split over {n} ranks")
    if t.is_cuda:
        out = t.new_empty((t.shape[0] // n, *t.shape[1:]))
        dist.reduce_scatter_tensor(out, t, group=group)
        return out
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t.narrow(0, rank * (t.shape[0] // n), t.shape[0] // n).contiguous()


# ----------------------------------------------------------------------------- strict mode
_GUARDED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
    "batch_isend_irecv", "barrier", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list",
)  # not isend/irecv: ``P2POp`` checks its op against torch's own functions (tests/unit/parallel/test_comm.py
#    scans the product's source for those)
_PRODUCT_DIRS = (
    str(Path(__file__).resolve().parents[1]) + os.sep,  # mcore_agentic/
    str(Path(__file__).resolve().parents[2] / "launch") + os.sep,
)
_THIS_FILE = str(Path(__file__).resolve())


def bypasses_policy(filename: str) -> bool:
    """Whether a collective called from ``filename`` skips this module: product code (``mcore_agentic/``,
    ``launch/``) must go through it; megatron-core, torch and tests call ``torch.distributed`` directly."""
    path = str(Path(filename).resolve()) if filename and not filename.startswith("<") else filename
    return path != _THIS_FILE and path.startswith(_PRODUCT_DIRS)


def _guard(name: str, fn: Any) -> Any:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if bypasses_policy(caller):
            frame = sys._getframe(1)
            raise CommPolicyError(
                f"torch.distributed.{name} called directly at {frame.f_code.co_filename}:{frame.f_lineno}: "
                "route it through mcore_agentic.parallel.comm (a host or a device call)"
            )
        return fn(*args, **kwargs)

    guarded._mcore_agentic_guard = fn  # type: ignore[attr-defined]
    guarded.__name__ = name
    return guarded


def enable_strict() -> None:
    """Turn on strict mode in this process (idempotent): raw collectives from product code raise, and host and
    device calls check where their tensors were placed."""
    global _STRICT
    if _STRICT:
        return
    for name in _GUARDED:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "_mcore_agentic_guard"):  # torch's own wrappers have __wrapped__
            setattr(dist, name, _guard(name, fn))
    _STRICT = True


def enable_strict_from_env() -> bool:
    """:func:`enable_strict` when ``MCORE_AGENTIC_STRICT_COMM`` is set to 1 (the test suite sets it); returns
    whether strict mode is on."""
    if os.environ.get(STRICT_ENV, "") == "1":
        enable_strict()
    return _STRICT


__all__ = [
    "CommPolicyError", "all_gather_device", "all_gather_host", "all_gather_object", "all_reduce_device",
    "all_reduce_host", "as_device", "as_host", "backend_for", "barrier", "broadcast_device", "broadcast_host",
    "broadcast_object", "compute_device", "device_empty", "device_zeros", "enable_strict", "exchange_host",
    "host_empty", "host_zeros", "place_of", "recv_link", "reduce_scatter_device", "send_link", "to_host",
]
