"""The distributed optimizer's state in a Megatron dist checkpoint: every DP rank writes and reads only its own shard.

megatron-core's reshardable layout of that state (its ``fully_reshardable`` sharding type) is in model space: per
model parameter, tensors ``optimizer.state.{param,exp_avg,exp_avg_sq}.<the parameter's key>`` of the parameter's
global shape and sharding, which load at any TP/PP/DP. megatron-core 0.16 only ever moves them whole: a save gathers
every DP rank's flat shard (over gloo onto DP rank 0, which alone writes; or all-gathered over NCCL into a host copy
on every rank), and a load allocates the TP/PP shard's whole state (12 bytes per parameter) in host memory on every
rank and reads all of it. Its other sharding types do not serve: ``dp_reshardable`` stores the optimizer's buckets,
which change with TP/PP (a resume at another TP could not read them), and ``fully_sharded_model_space`` describes a
rank's part with ``ShardedTensor.flattened_range``, which megatron-core 0.16 no longer accepts.

Here the same tensors are written and read in pieces. A DP rank owns a contiguous range of each of its parameters'
flattened local tensor; :func:`flat_boxes` cuts that range into boxes (a partial first row, whole rows, a partial
last row, recursively), and each box is a ``ShardedTensor`` of the tensor's key and global shape whose data is a
view of the optimizer's own state. A save writes every rank's boxes, with no gather and no copy; a load asks for
every rank's boxes, which torch.distributed.checkpoint reads from whatever chunks were saved (these pieces at any
TP/PP/DP, or megatron-core's own whole-tensor ``fully_reshardable`` save, which ``model_checkpoint`` used before)
straight into the optimizer's state. The checkpoint is still a ``fully_reshardable`` one: megatron-core loads it.

A load first restores the optimizer's plain state (:func:`load_plain_state`: param groups, Adam's step, which also
allocates the state tensors of a never-stepped optimizer), then loads the pieces into that state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SHARDING_TYPE = "fully_reshardable"
"""The common state's ``param_state_sharding_type``: the tensors are megatron-core's ``fully_reshardable`` ones."""
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The per-parameter tensors of megatron-core's ``fully_reshardable`` layout (main parameter, Adam's moments)."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of a tensor: its offset and size per dimension."""


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Boxes covering the elements ``[start, stop)`` of a C-contiguous tensor of ``shape``, in flat order.

    Each box is itself a contiguous run of those elements: at most two partial rows and one block of whole rows
    per dimension, so at most ``2 * len(shape) - 1`` boxes.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    rest = tuple(shape[1:])
    row = math.prod(rest)
    first, end = -(-start // row), stop // row  # the first whole row, the end of the whole rows

    def within(index: int, lo: int, hi: int) -> list[Box]:
        return [((index, *o), (1, *s)) for o, s in flat_boxes(rest, lo - index * row, hi - index * row)]

    if first > end:  # inside one row
        return within(end, start, stop)
    boxes = within(first - 1, start, first * row) if start < first * row else []
    if end > first:
        boxes.append(((first, *(0,) * len(rest)), (end - first, *rest)))
    if stop > end * row:
        boxes += within(end, end * row, stop)
    return boxes


def leaves(optimizer: Any) -> list[Any]:
    """The optimizers inside ``optimizer`` (a ``ChainedOptimizer``'s, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def applies(optimizer: Any) -> bool:
    """Whether ``optimizer``'s state is saved here: megatron-core's distributed optimizer (not megatron-FSDP's)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return all(
        isinstance(o, DistributedOptimizer) and not o.ddp_config.use_megatron_fsdp for o in leaves(optimizer)
    )


def _per_leaf(states: list[dict[str, Any]]) -> dict[Any, Any]:
    """The leaves' states as megatron-core's ``ChainedOptimizer`` nests them: one leaf's alone, else by index."""
    return states[0] if len(states) == 1 else dict(enumerate(states))


def _leaf_states(optimizer: Any, state: dict[Any, Any]) -> list[dict[str, Any]]:
    n = len(leaves(optimizer))
    return [state] if n == 1 else [state[i] for i in range(n)]


def _local_params(optimizer: Any) -> Iterator[tuple[torch.nn.Parameter, int, int]]:
    """This DP rank's model parameters and the range of each one's flattened local tensor that it owns."""
    for by_dtype in optimizer.gbuf_ranges:
        for buckets in by_dtype.values():
            for bucket in buckets:
                for param, ranges in bucket["param_map"].items():
                    yield param, ranges["param"].start, ranges["param"].end


def _saved_as(meta: Any, param: torch.Tensor) -> list[tuple[Any, int]]:
    """The ``ShardedTensor``s the model saves ``param`` as, each with the index of its first element in ``param``.

    A ``ShardedTensorFactory`` (SwiGLU's fc1: two halves under one key) is built into its tensors, each a contiguous
    part of the parameter."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    built = list(nested_values(meta.build())) if isinstance(meta, ShardedTensorFactory) else [meta]
    out = []
    for sh in built:
        data = sh.data
        if (sh.flattened_range is not None or not data.is_contiguous()
                or data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()):
            raise ValueError(f"{sh.key}: its checkpoint tensor is not a contiguous part of the model parameter")
        out.append((sh, data.storage_offset() - param.storage_offset()))
    return out


def _pieces(meta: Any, param: torch.Tensor, start: int, stop: int, state: dict[str, torch.Tensor],
            replica_id: tuple[int, ...]) -> dict[str, dict[int, Any]]:
    """``state`` (this rank's flat range ``[start, stop)`` of ``param``) as boxes of the model-space tensors."""
    out: dict[str, dict[int, Any]] = {key: {} for key in STATE_KEYS}
    for key in STATE_KEYS:
        if state[key].shape != (stop - start,):
            raise ValueError(f"{meta.key}: optimizer state {key!r} is not this rank's flat range of the parameter")
    for sh, offset in _saved_as(meta, param):
        lo, hi = max(start, offset), min(stop, offset + sh.data.numel())
        at = lo - start  # where the box's elements are in the flat state
        axes = sh.prepend_axis_num  # leading global axes the local tensor lacks (a box has them, of size 1)
        for corner, size in flat_boxes(sh.local_shape, lo - offset, hi - offset):
            n = math.prod(size)
            shape = (1,) * axes + size
            global_offset = (*sh.global_offset[:axes], *(g + c for g, c in zip(sh.global_offset[axes:], corner)))
            for key in STATE_KEYS:
                view = state[key].detach()[at:at + n].view(shape)
                out[key][len(out[key])] = replace(
                    sh, key=f"optimizer.state.{key}.{sh.key}", data=view, dtype=view.dtype, local_shape=shape,
                    global_offset=global_offset, axis_fragmentations=None, replica_id=replica_id, prepend_axis_num=0,
                )
            at += n
    return out


def _leaf_pieces(optimizer: Any, model_tensors: dict[Any, Any]) -> tuple[dict[int, Any], Callable[[dict], None]]:
    """One distributed optimizer's pieces, and the function that puts loaded pieces into its state."""
    param_state: dict[int, Any] = {}
    held: list[tuple[Any, dict[str, Any], dict[str, dict[int, Any]]]] = []
    for index, (param, start, stop) in enumerate(_local_params(optimizer)):
        meta = model_tensors.get(param)
        if meta is None:
            raise ValueError("a parameter of the optimizer is missing from the model's sharded state dict")
        if len(meta.replica_id) != 3:
            raise ValueError(f"{meta.key}: expected a (PP, TP, DP) replica id, got {meta.replica_id}")
        # Unique across DP (each rank its own range); across distributed-optimizer instances, copies.
        replica_id = (*meta.replica_id[:2], optimizer.distributed_optimizer_instance_id)
        state = optimizer._get_main_param_and_optimizer_states(param)
        param_state[index] = _pieces(meta, param, start, stop, state, replica_id)
        views = {key: {j: piece.data for j, piece in pieces.items()} for key, pieces in param_state[index].items()}
        held.append((param, state, views))

    def put(loaded: dict[int, Any]) -> None:
        import torch
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

        with torch.no_grad():
            _put(loaded)
        if isinstance(optimizer.optimizer, HybridDeviceOptimizer):
            optimizer.optimizer._sync_hdo_state_to_sub_optimizers()

    def _put(loaded: dict[int, Any]) -> None:
        for index, (param, state, views) in enumerate(held):
            for key, by_index in views.items():
                for j, view in by_index.items():
                    got = loaded[index][key][j]
                    if got.data_ptr() != view.data_ptr():  # not loaded in place
                        view.copy_(got)
            # The state itself when it is the optimizer's tensors (a no-op then); a precision-aware optimizer's
            # unscaled copies are scaled back in.
            optimizer._set_main_param_and_optimizer_states(param, state)

    return param_state, put


def sharded_state_dict(optimizer: Any, model_sharded_state_dict: dict[str, Any], *,
                       is_loading: bool) -> tuple[dict[Any, Any], Callable[[dict], None]]:
    """``optimizer``'s sharded state dict, and the function that takes in what ``dist_checkpointing.load`` returns
    for it (collective where the load is).

    Save: the plain state (param groups, step, grad scaler) and the pieces. Load: the pieces only, into the state
    that :func:`load_plain_state` allocated and restored first.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    model_tensors = {sh.data: sh for sh in nested_values(model)}  # keyed by the parameter (tensors hash by identity)
    chained = leaves(optimizer)
    if len(chained) > 1 and not is_loading:
        optimizer._synchronize_steps()  # as ChainedOptimizer.sharded_state_dict does (TE's FusedAdam's step)
    states, puts = [], []
    for leaf in chained:
        param_state, put = _leaf_pieces(leaf, model_tensors)
        plain = {} if is_loading else {**leaf.state_dict(), "param_state_sharding_type": SHARDING_TYPE}
        states.append({**plain, "param_state": param_state})
        puts.append(put)

    def finish(loaded: dict[Any, Any]) -> None:
        for put, state in zip(puts, _leaf_states(optimizer, loaded)):
            put(state.get("param_state") or {})  # none: a rank that owns no parameters of this optimizer

    return _per_leaf(states), finish


def load_plain_state(optimizer: Any, saved: dict[Any, Any]) -> None:
    """Restore ``optimizer``'s plain state from a checkpoint's common state (before :func:`sharded_state_dict`).

    megatron-core's ``load_state_dict`` without the parameter state: param groups, Adam's step, the grad scaler;
    it allocates the state tensors of a never-stepped optimizer, into which the pieces then load.
    """
    plain = [{k: v for k, v in s.items() if k != "param_state"} for s in _leaf_states(optimizer, saved)]
    optimizer.load_state_dict(_per_leaf(plain))


__all__ = ["SHARDING_TYPE", "STATE_KEYS", "applies", "flat_boxes", "leaves", "load_plain_state", "sharded_state_dict"]
