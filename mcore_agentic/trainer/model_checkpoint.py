"""Megatron distributed checkpoints of the trained workers: model, optimizer, LR schedule, update counter.

Each trained worker (actor, critic) is written into its own subdirectory of a
checkpoint step directory (``actor/``, ``critic/``) by megatron-core's
``dist_checkpointing`` in the ``torch_dist`` format, from every rank (SPMD):

* ``model`` (``model<i>`` per virtual-pipeline chunk): the chunks' sharded state
  dicts. Each tensor is stored with its global shape and offsets, so a checkpoint
  written at one TP/PP/DP layout loads at another.
* ``optimizer``: ``optimizer.sharded_state_dict(model_sd, metadata=...)``. For the
  distributed optimizer the sharding type decides what can change on resume:
  ``dp_reshardable`` stores the optimizer's flat per-DP-rank buckets, whose layout
  depends on TP/PP, so it reshards across DP only. We use ``fully_reshardable``:
  at save the buckets are all-gathered over DP and cut back into model-parameter
  shaped tensors (``param``/``exp_avg``/``exp_avg_sq`` per parameter, sharded like
  the parameter), which load at any TP/PP/DP. The price is a gather over DP at
  save: we use the memory-efficient mode (gloo gather of CPU tensors to DP rank 0,
  which writes the optimizer state; the default all-gathers on the GPU and cannot
  run on CPU). On load every rank reads the model-space tensors it needs and cuts
  its own flat shard. The non-distributed optimizer's state is already in model
  space.
* ``scheduler`` (``OptimizerParamScheduler.state_dict()``), ``updates`` (the
  worker's update counter, which seeds its mini-batch shuffle) and ``contents``:
  plain (common) state, written once by rank 0 and read by every rank.

Usage with :class:`~mcore_agentic.trainer.checkpoint.CheckpointManager`::

    manager.save(step, trainer_state, writers=model_state_writers(actor=actor, critic=critic))
    manager.load(path, readers=model_state_readers(actor=actor, critic=critic))

or directly ``save_model_state(step_dir, actor=..., critic=...)`` /
``load_model_state(step_dir, actor=..., critic=...)``. Every rank must call.
A weights-only load (``load_optimizer=False``, or an engine built with
``optim=None``) is the path of an HF export from a checkpoint. Offloaded workers
are reloaded for the save/load and offloaded again afterwards.

``torch_dist``'s file writer starts a ``spawn``-context manager process (which
re-imports the main module) and needs ``psutil``: scripts that save must keep
their work under ``if __name__ == "__main__"``.

megatron-core 0.16.1 with torch's Adam (no Apex/TransformerEngine, i.e. on CPU)
needs three fixes here, each a no-op with TE/Apex: placeholder Adam state before
building a loading state dict, ``step`` set aside in the fully-reshardable tensor
load, and per-parameter ``step`` tensors after it (see :func:`_load_optimizer`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcore_agentic.models.bridge import unwrap_model

logger = logging.getLogger(__name__)

FORMAT = "mcore_agentic.model_checkpoint/1"
OPTIMIZER_SHARDING_TYPE = "fully_reshardable"
"""Distributed-optimizer sharding type: reshardable across TP, PP and DP (see the module docstring)."""


def _sharded_metadata() -> dict[str, Any]:
    # chained_optim_avoid_prefix: no "chained_<i>." prefix on fully-reshardable keys (Megatron-LM's default too);
    # singleton_local_shards=False: the (current) one-shard-per-tensor layout of model tensors.
    return {
        "distrib_optim_sharding_type": OPTIMIZER_SHARDING_TYPE,
        # Gather the optimizer state with gloo into CPU tensors on DP rank 0 (which writes it). The
        # default all-gathers on the GPU (`.cuda()`, so not on CPU) and would hold DP copies there.
        "distrib_optim_fully_reshardable_mem_efficient": True,
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
    }


def _engine(worker: Any) -> Any:
    engine = getattr(worker, "engine", worker)
    if not hasattr(engine, "chunks"):
        raise TypeError(f"{type(worker).__name__} is neither a worker with an .engine nor a MegatronEngine")
    return engine


_OFFLOAD_GROUPS = ("params", "grads", "optimizer")


@contextmanager
def _onloaded(engine: Any) -> Iterator[None]:
    """Bring offloaded state back for the duration (save reads it, load writes it), then offload it again.

    Loading into offloaded storage would be undone by the next ``reload()``, which copies
    the bytes saved at offload time back in; so we reload first and offload afterwards.
    """
    offloaded = [g for g in _OFFLOAD_GROUPS if engine.offloader.is_offloaded(g)]
    if offloaded:
        engine.reload()
    try:
        yield
    finally:
        if offloaded:
            engine.offload(**{g: g in offloaded for g in _OFFLOAD_GROUPS})


@contextmanager
def weights_only_byte_entries() -> Iterator[None]:
    """Load the byte entries of ``.distcp`` shards weights-only for the duration.

    torch.distributed.checkpoint stores non-tensor values (Megatron's ``_extra_state``
    ShardedObjects) as ``torch.save`` bytes and reads them back in
    ``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=False)``: a value planted
    in a shard would run code on resume. Here they load with ``weights_only=True``; the one
    non-tensor type such entries hold (TransformerEngine's ``io.BytesIO`` extra state) is
    allowed by name. Megatron's load planner inherits the method, so both are covered.
    """
    import io

    import torch
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    original = DefaultLoadPlanner.load_bytes

    def load_bytes(self: Any, read_item: Any, value: Any) -> None:
        with torch.serialization.safe_globals([io.BytesIO]):
            obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        DefaultLoadPlanner.load_bytes = original


def _load_sharded(sharded: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``dist_checkpointing.load`` with weights-only byte entries; its failure is one line naming the directory.

    torch.distributed.checkpoint raises ``CheckpointException``, a ``BaseException`` holding each
    rank's traceback; a resume reports the first line of the first failure instead.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from mcore_agentic.trainer.checkpoint import CheckpointError

    try:
        with weights_only_byte_entries():
            return dist_checkpointing.load(sharded, str(directory))
    except CheckpointException as exc:
        failure = next(iter(exc.failures.values()), exc) if getattr(exc, "failures", None) else exc
        first = next((line for line in str(failure).splitlines() if line.strip()), type(failure).__name__)
        raise CheckpointError(
            "trainer.resume_from_path", f"{directory} cannot be loaded ({first.strip()[:200]}): resume from another checkpoint"
        ) from None


def _model_keys(chunks: list[Any]) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _prime_empty_adam_state(optimizer: Any) -> None:
    """Give a never-stepped distributed optimizer placeholder Adam state, so that it can be loaded into.

    ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` starts from
    ``state_dict()``, which (with torch's Adam, i.e. without Apex/TransformerEngine)
    reads each parameter's ``step`` and fails on an optimizer that has not stepped yet.
    The placeholders (zeros, step 0) are overwritten by the load; with TE/Apex the
    step lives in the param groups and nothing is needed.
    """
    import torch
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, distrib_optimizer.DistributedOptimizer):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )


def _load_optimizer(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict(state)``, working around a torch-Adam gap of the fully-reshardable load.

    ``DistributedOptimizer.load_parameter_state_from_fully_reshardable`` copies every
    entry of the torch optimizer's per-parameter state from the checkpoint; torch's
    Adam (used without Apex/TransformerEngine) keeps ``step`` there, which the
    checkpoint carries in the param groups instead, so megatron-core 0.16.1 raises
    ``KeyError: 'step'``. We load the param groups (and ``step``) first, then the
    tensors with ``step`` set aside. Identical to Megatron's own path when no ``step``
    is kept per parameter (TE/Apex).

    Second gap, same path: ``DistributedOptimizer.load_state_dict`` gives every
    parameter the *same* ``step`` tensor object, and torch's Adam increments each
    parameter's ``step`` in place, so after a resume one optimizer step advanced it
    once per parameter (wrong bias correction from the second step on). Each
    parameter gets its own copy here.
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        pairs = [(optimizer, state)]
    elif len(chained) == 1:
        pairs = [(chained[0], state)]
    else:
        pairs = list(zip(chained, (v for _, v in sorted(state.items()))))
    for opt, sd in pairs:
        if not (isinstance(opt, DistributedOptimizer) and sd.get("param_state_sharding_type") == "fully_reshardable"):
            opt.load_state_dict(sd)
            continue
        opt.load_state_dict({k: v for k, v in sd.items() if k not in ("param_state", "param_state_sharding_type")})
        per_param = opt.optimizer.state
        steps = {p: s.pop("step") for p, s in per_param.items() if "step" in s}
        try:
            opt.load_parameter_state_from_fully_reshardable(sd["param_state"])
        finally:
            for p, step in steps.items():
                per_param[p]["step"] = step
    for opt, _ in pairs:
        inner = getattr(opt, "optimizer", None)
        for param_state in (inner.state.values() if inner is not None else ()):
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                param_state["step"] = step.clone()
    if chained is not None and len(chained) > 1:
        optimizer._synchronize_steps()


def _drop_gathered_param_state(common: dict[str, Any]) -> dict[str, Any]:
    """For the cross-rank consistency check: ``optimizer.param_state`` is gathered on DP rank 0 only."""
    optimizer = common.get("optimizer")
    if isinstance(optimizer, dict) and "param_state" in optimizer:
        return {**common, "optimizer": {k: v for k, v in optimizer.items() if k != "param_state"}}
    return common


def _state_dict(worker: Any, *, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
    """The sharded state dict of ``worker`` (model, optimizer) plus its plain state."""
    engine = _engine(worker)
    metadata = _sharded_metadata()
    state: dict[str, Any] = {}
    for key, chunk in zip(_model_keys(engine.chunks), engine.chunks):
        # The bare GPTModel (no DDP/Float16Module "module." level): the same keys whatever the wrapping.
        state[key] = unwrap_model(chunk).sharded_state_dict(metadata=metadata)
    contents = ["model"]
    if with_optimizer:
        # The optimizer's sharded dict refers to the model's ShardedTensors (it copies their keys/offsets).
        model_sd = {k: state[k] for k in _model_keys(engine.chunks)}
        if len(engine.chunks) == 1:
            model_sd = model_sd["model"]
        if is_loading:
            _prime_empty_adam_state(engine.optimizer)
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        state["scheduler"] = engine.scheduler.state_dict()
        contents.append("optimizer")
    # Plain values are "common" state: rank 0 writes them, every rank reads them.
    state["updates"] = int(getattr(worker, "_updates", 0))
    state["contents"] = contents
    state["format"] = FORMAT
    return state


def save_worker(directory: str | os.PathLike, worker: Any, *, with_optimizer: bool | None = None) -> None:
    """Write ``worker`` (an Actor/Critic, or a bare MegatronEngine) into ``directory`` (collective).

    ``with_optimizer`` defaults to whether the engine is trainable. ``directory``
    must exist and be empty (the checkpoint manager creates it).
    """
    from megatron.core import dist_checkpointing

    engine = _engine(worker)
    if with_optimizer is None:
        with_optimizer = engine.optimizer is not None
    if with_optimizer and engine.optimizer is None:
        raise ValueError("save_worker(with_optimizer=True): this engine has no optimizer (built with optim=None)")
    with _onloaded(engine):
        state = _state_dict(worker, with_optimizer=with_optimizer, is_loading=False)
        dist_checkpointing.save(
            state, str(directory), preprocess_common_before_consistancy_check=_drop_gathered_param_state
        )


def load_worker(directory: str | os.PathLike, worker: Any, *, load_optimizer: bool = True) -> dict[str, Any]:
    """Load ``directory`` (written by :func:`save_worker`, at any TP/PP/DP) into ``worker`` (collective).

    Restores the model; with ``load_optimizer`` (and a trainable engine) also the
    optimizer state, the LR schedule and the worker's update counter. Returns the
    checkpoint's plain state (``contents``, ``updates``, ``scheduler``).
    """
    from megatron.core import dist_checkpointing

    engine = _engine(worker)
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model checkpoint directory {directory} does not exist")
    common = dist_checkpointing.load_common_state_dict(str(directory))
    if common.get("format") != FORMAT:
        raise ValueError(f"{directory}: not a {FORMAT} checkpoint (format={common.get('format')!r})")
    want_optimizer = load_optimizer and engine.optimizer is not None
    if want_optimizer and "optimizer" not in common["contents"]:
        raise ValueError(
            f"{directory} holds no optimizer state (saved without an optimizer): "
            "load it with load_optimizer=False to take the weights only"
        )
    with _onloaded(engine):
        sharded = _state_dict(worker, with_optimizer=want_optimizer, is_loading=True)
        for key in ("updates", "contents", "format"):
            sharded.pop(key)
        if not want_optimizer:
            sharded.pop("scheduler", None)
        loaded = _load_sharded(sharded, directory)
        for key, chunk in zip(_model_keys(engine.chunks), engine.chunks):
            unwrap_model(chunk).load_state_dict(loaded[key], strict=True)
        if want_optimizer:
            _load_optimizer(engine.optimizer, loaded["optimizer"])
            # Sets num_steps and the optimizer's lr/wd from the schedule; refuses a changed lr/warmup/decay config.
            engine.scheduler.load_state_dict(common["scheduler"])
            if hasattr(worker, "_updates"):
                worker._updates = int(common["updates"])
    return common


def save_model_state(ckpt_dir: str | os.PathLike, *, actor: Any = None, critic: Any = None) -> None:
    """Write each given worker into ``ckpt_dir/<actor|critic>/`` (collective; the dirs must exist and be empty)."""
    for name, worker in (("actor", actor), ("critic", critic)):
        if worker is not None:
            save_worker(Path(ckpt_dir) / name, worker)


def load_model_state(
    ckpt_dir: str | os.PathLike, *, actor: Any = None, critic: Any = None, load_optimizer: bool = True
) -> None:
    """Load ``ckpt_dir/<actor|critic>/`` into each given worker (collective)."""
    for name, worker in (("actor", actor), ("critic", critic)):
        if worker is not None:
            load_worker(Path(ckpt_dir) / name, worker, load_optimizer=load_optimizer)


def model_state_writers(*, actor: Any = None, critic: Any = None, ref: Any = None) -> dict[str, Callable[[Path], None]]:
    """``CheckpointManager.save(writers=...)`` callbacks: one subdirectory per given worker.

    ``ref``: a reference model whose weights changed during the run (re-anchored after the SFT
    warm start); its weights only, since it has no optimizer.
    """
    workers = {"actor": actor, "critic": critic, "ref": ref}
    return {name: (lambda d, w=w: save_worker(d, w)) for name, w in workers.items() if w is not None}


def model_state_readers(
    *, actor: Any = None, critic: Any = None, ref: Any = None, load_optimizer: bool = True
) -> dict[str, Callable[[Path], None]]:
    """``CheckpointManager.load(readers=...)`` callbacks matching :func:`model_state_writers`."""
    workers = {"actor": actor, "critic": critic, "ref": ref}
    return {
        name: (lambda d, w=w, n=name: load_worker(d, w, load_optimizer=load_optimizer and n != "ref"))
        for name, w in workers.items()
        if w is not None
    }


__all__ = [
    "OPTIMIZER_SHARDING_TYPE",
    "load_model_state",
    "load_worker",
    "model_state_readers",
    "model_state_writers",
    "save_model_state",
    "save_worker",
]
