"""Patch ``dist_checkpointing_weights_only``: ``dist_checkpointing`` loads the byte entries of ``.distcp`` shards weights-only.

Target: ``megatron.core.dist_checkpointing.strategies.torch.MCoreLoadPlanner.load_bytes``
(inherited from ``torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes``;
the patch defines it on ``MCoreLoadPlanner``, the planner of every megatron-core ``torch_dist``
load, and leaves torch's own planner alone).

Reason: a security fix, not a device one (applied on GPU too). ``torch_dist`` stores every
non-tensor value (each ``ShardedObject`` of a sharded state dict, e.g. TransformerEngine's
``_extra_state``) as ``torch.save`` bytes inside the ``.distcp`` shards, and torch reads them
back with ``torch.load(value, weights_only=False)``: a pickle planted in a shard runs code on
resume. The replacement loads them with ``weights_only=True`` and allows by name the one
non-tensor type such entries hold (``io.BytesIO``, TransformerEngine's extra state); it
stores the value exactly where torch's method does. A planted pickle now fails the load
(``CheckpointException``: "Weights only load failed"). The checkpoint manifest
(``mcore_agentic.trainer.manifest``) separately vets the ``.metadata`` pickle, which torch
unpickles outside the planner.

Upstream: torch 2.13 ``DefaultLoadPlanner.load_bytes`` hard-codes ``weights_only=False``;
megatron-core 0.16.1 ``MCoreLoadPlanner`` does not override it. No upstream issue known to us.

Versions: megatron-core 0.16.x (run and tested on 0.16.1 with torch 2.13). Remove when torch's
planner (or megatron-core's) loads byte entries weights-only.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from megatron_patches._base import Patch, PatchContext

_MODULE = "megatron.core.dist_checkpointing.strategies.torch"

SAFE_TYPES: tuple[type, ...] = (io.BytesIO,)
"""Non-tensor types a byte entry may hold besides what ``weights_only=True`` allows anyway."""


def load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint.default_planner import set_element

    with torch.serialization.safe_globals(list(SAFE_TYPES)):
        obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def _install(ctx: PatchContext) -> None:
    ctx.swap(ctx.attr(_MODULE, "MCoreLoadPlanner"), "load_bytes", load_bytes)


PATCH = Patch(
    name="dist_checkpointing_weights_only",
    reason="torch_dist byte entries (ShardedObjects) are unpickled with torch.load(weights_only=False)",
    install=_install,
    cpu_only=False,
)
