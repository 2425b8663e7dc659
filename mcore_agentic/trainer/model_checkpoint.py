"""Megatron distributed checkpoints of the trained workers: model, optimizer, LR schedule, update counter.

Each trained worker (actor, critic) is written into its own subdirectory of a
checkpoint step directory (``actor/``, ``critic/``) by megatron-core's
``dist_checkpointing`` in the ``torch_dist`` format, from every rank (SPMD):

* ``model`` (``model<i>`` per virtual-pipeline chunk): the chunks' sharded state
  dicts. Each tensor is stored with its global shape and offsets, so a checkpoint
  written at one TP/PP/DP layout loads at another.
* ``optimizer``: the distributed optimizer's state in megatron-core's ``fully_reshardable``
  layout (``param``/``exp_avg``/``exp_avg_sq`` per parameter, shaped and sharded like the
  parameter), which loads at any TP/PP/DP, written and read by :mod:`.optimizer_shards`:
  every DP rank saves and loads only its own shard, in place, with no gather (megatron-core
  0.16 gathers it onto one writer, and allocates the whole of it on every rank at load).
  The non-distributed optimizer's state is already in model space:
  ``optimizer.sharded_state_dict(model_sd, metadata=...)``.
* ``scheduler`` (``OptimizerParamScheduler.state_dict()``), ``updates`` (the
  worker's update counter, which seeds its mini-batch shuffle) and ``contents``:
  plain (common) state, written once by rank 0 and read by every rank.

A save spreads the writes of what DP ranks hold alike (the model) over the DP group
(megatron's ``FullyParallelSaveStrategyWrapper``: metadata only, so on gloo too); on a GPU a
load reads each such tensor once per DP group and broadcasts it (``FullyParallelLoadStrategyWrapper``,
whose exchange is on CUDA).

Usage with :class:`~mcore_agentic.trainer.checkpoint.CheckpointManager`::

    manager.save(step, trainer_state, writers=model_state_writers(actor=actor, critic=critic))
    manager.load(path, readers=model_state_readers(actor=actor, critic=critic))

or per worker ``save_worker(dir, worker)`` / ``load_worker(dir, worker)``. Every rank must call.
A weights-only load (``load_optimizer=False``, or a model built with
``optim=None``) is the path of an HF export from a checkpoint. Offloaded workers
are reloaded for the save/load and offloaded again afterwards.

``torch_dist``'s file writer starts a ``spawn``-context manager process (which
re-imports the main module) and needs ``psutil``: scripts that save must keep
their work under ``if __name__ == "__main__"``.

Loading relies on ``megatron_patches`` (applied by ``launch/`` and tests; this package never
imports it): ``dist_checkpointing_weights_only`` loads the byte entries of ``.distcp`` shards
weights-only (torch would unpickle them with ``weights_only=False``), and the
``distopt_load_*`` patches fix megatron-core 0.16.1's distributed-optimizer load with torch's
Adam (no Apex/TransformerEngine, i.e. on CPU). :func:`load_worker` refuses to run without
them (:func:`_require_checkpoint_patches`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcore_agentic.models.bridge import unwrap_model
from mcore_agentic.trainer import optimizer_shards

logger = logging.getLogger(__name__)

FORMAT = "mcore_agentic.model_checkpoint/1"
OPTIMIZER_SHARDING_TYPE = optimizer_shards.SHARDING_TYPE
"""Distributed-optimizer sharding type: reshardable across TP, PP and DP (see the module docstring)."""


def _sharded_metadata() -> dict[str, Any]:
    # chained_optim_avoid_prefix: no "chained_<i>." prefix on fully-reshardable keys (Megatron-LM's default too);
    # singleton_local_shards=False: the (current) one-shard-per-tensor layout of model tensors.
    return {
        "distrib_optim_sharding_type": OPTIMIZER_SHARDING_TYPE,
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
    }


def _megatron_model(worker: Any) -> Any:
    model = getattr(worker, "model", worker)
    if not hasattr(model, "chunks"):
        raise TypeError(f"{type(worker).__name__} is neither a worker with a .model nor a MegatronModel")
    return model


_OFFLOAD_GROUPS = ("params", "grads", "optimizer")


@contextmanager
def _onloaded(model: Any) -> Iterator[None]:
    """Bring offloaded state back for the duration (save reads it, load writes it), then offload it again.

    Loading into offloaded storage would be undone by the next ``reload()``, which copies
    the bytes saved at offload time back in; so we reload first and offload afterwards.
    """
    offloaded = [g for g in _OFFLOAD_GROUPS if model.offloader.is_offloaded(g)]
    if offloaded:
        model.reload()
    try:
        yield
    finally:
        if offloaded:
            model.offload(**{g: g in offloaded for g in _OFFLOAD_GROUPS})


def _dp_group(model: Any) -> Any:
    """The group whose ranks hold the same model shard (DP x CP), or None when it is this rank alone."""
    group = model.layout.dp_group(with_context_parallel=True)
    return group if group.size() > 1 else None


def _save_strategy(model: Any) -> Any:
    """torch_dist, with what DP ranks hold alike written by one of them each, spread over the DP group."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy()
    group = _dp_group(model)
    return FullyParallelSaveStrategyWrapper(strategy, group) if group is not None else strategy


def _load_strategy(model: Any, directory: Path) -> Any:
    """torch_dist; on a GPU, what DP ranks hold alike is read once per DP group and broadcast (over NCCL)."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(str(directory))
    group = _dp_group(model)
    if group is None or model.device.type != "cuda":  # the wrapper's exchange and syncs are CUDA's
        return strategy
    return FullyParallelLoadStrategyWrapper(strategy, group)


def _load_sharded(sharded: dict[str, Any], directory: Path, model: Any) -> dict[str, Any]:
    """``dist_checkpointing.load``; its failure is one line naming the directory.

    torch.distributed.checkpoint raises ``CheckpointException``, a ``BaseException`` holding each
    rank's traceback; a resume reports the first line of the first failure instead.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from mcore_agentic.trainer.checkpoint import CheckpointError
    from mcore_agentic.utils.errors import first_line

    try:
        return dist_checkpointing.load(sharded, str(directory), sharded_strategy=_load_strategy(model, directory))
    except CheckpointException as exc:
        failure = next(iter(exc.failures.values()), exc) if getattr(exc, "failures", None) else exc
        raise CheckpointError(
            "trainer.resume_from_path", f"{directory} cannot be loaded ({first_line(failure)}): resume from another checkpoint"
        ) from None


def _model_keys(chunks: list[Any]) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _require_checkpoint_patches() -> None:
    """Refuse to load unless the checkpoint-load patches of ``megatron_patches`` are in effect.

    Without ``dist_checkpointing_weights_only`` a pickle planted in a ``.distcp`` shard would
    run on load; without the ``distopt_load_*`` patches the torch-Adam optimizer load raises,
    or (``distopt_load_shared_step``) silently trains on with a wrong Adam step. This package
    never imports ``megatron_patches``; it looks for it among the loaded modules, like
    ``parallel.layout.initialize_parallel`` does.
    """
    patches = sys.modules.get("megatron_patches")
    needed = getattr(patches, "CHECKPOINT_PATCH_NAMES", None)
    missing = [n for n in needed if n not in patches.applied()] if needed is not None else ["all"]
    if missing:
        raise RuntimeError(
            f"loading a model checkpoint needs megatron_patches.apply() first (not applied: {', '.join(missing)})"
        )


def _state_dict(
    worker: Any, *, with_optimizer: bool, is_loading: bool
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None] | None]:
    """The sharded state dict of ``worker`` (model, optimizer) plus its plain state, and (with the optimizer) the
    function that takes the loaded optimizer state in."""
    model = _megatron_model(worker)
    metadata = _sharded_metadata()
    state: dict[str, Any] = {}
    for key, chunk in zip(_model_keys(model.chunks), model.chunks):
        # The bare GPTModel (no DDP/Float16Module "module." level): the same keys whatever the wrapping.
        state[key] = unwrap_model(chunk).sharded_state_dict(metadata=metadata)
    contents = ["model"]
    take_in = None
    if with_optimizer:
        # The optimizer's sharded dict refers to the model's ShardedTensors (it copies their keys/offsets).
        model_sd = {k: state[k] for k in _model_keys(model.chunks)}
        if len(model.chunks) == 1:
            model_sd = model_sd["model"]
        if optimizer_shards.applies(model.optimizer):
            state["optimizer"], take_in = optimizer_shards.sharded_state_dict(
                model.optimizer, model_sd, is_loading=is_loading
            )
        else:
            state["optimizer"] = model.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=metadata
            )
            take_in = model.optimizer.load_state_dict
        state["scheduler"] = model.scheduler.state_dict()
        contents.append("optimizer")
    # Plain values are "common" state: rank 0 writes them, every rank reads them.
    state["updates"] = int(getattr(worker, "_updates", 0))
    state["contents"] = contents
    state["format"] = FORMAT
    return state, take_in


def save_worker(directory: str | os.PathLike, worker: Any, *, with_optimizer: bool | None = None) -> None:
    """Write ``worker`` (an Actor/Critic, or a bare MegatronModel) into ``directory`` (collective).

    ``with_optimizer`` defaults to whether the model is trainable. ``directory``
    must exist and be empty (the checkpoint manager creates it).
    """
    from megatron.core import dist_checkpointing

    model = _megatron_model(worker)
    if with_optimizer is None:
        with_optimizer = model.optimizer is not None
    if with_optimizer and model.optimizer is None:
        raise ValueError("save_worker(with_optimizer=True): this model has no optimizer (built with optim=None)")
    with _onloaded(model):
        state, _ = _state_dict(worker, with_optimizer=with_optimizer, is_loading=False)
        dist_checkpointing.save(state, str(directory), sharded_strategy=_save_strategy(model))


def load_worker(
    directory: str | os.PathLike, worker: Any, *, load_optimizer: bool = True, optim_from: str = "checkpoint"
) -> dict[str, Any]:
    """Load ``directory`` (written by :func:`save_worker`, at any TP/PP/DP) into ``worker`` (collective).

    Restores the model; with ``load_optimizer`` (and a trainable model) also the
    optimizer state, the LR schedule and the worker's update counter. Returns the
    checkpoint's plain state (``contents``, ``updates``, ``scheduler``).
    ``optim_from`` (``trainer.resume_optim_from``): ``checkpoint`` keeps the saved schedule's settings
    (lr, min_lr, warmup, decay, weight decay) and the optimizer's betas and eps; ``config`` keeps the
    model's own (this run's config), continuing from the saved step.
    """
    from megatron.core import dist_checkpointing

    model = _megatron_model(worker)
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model checkpoint directory {directory} does not exist")
    _require_checkpoint_patches()
    common = dist_checkpointing.load_common_state_dict(str(directory))
    if common.get("format") != FORMAT:
        raise ValueError(f"{directory}: not a {FORMAT} checkpoint (format={common.get('format')!r})")
    want_optimizer = load_optimizer and model.optimizer is not None
    if want_optimizer and "optimizer" not in common["contents"]:
        raise ValueError(
            f"{directory} holds no optimizer state (saved without an optimizer): "
            "load it with load_optimizer=False to take the weights only"
        )
    with _onloaded(model):
        if want_optimizer:
            # Megatron keeps each group's max_lr/min_lr in the group (get_lr reads them first): this run's, with Adam's.
            mine = [{k: g[k] for k in ("betas", "eps", "max_lr", "min_lr") if k in g} for g in model.optimizer.param_groups]
            if optimizer_shards.applies(model.optimizer):
                # Param groups and step first; it allocates a fresh optimizer's state, which the shards load into.
                optimizer_shards.load_plain_state(model.optimizer, common["optimizer"])
        sharded, take_in = _state_dict(worker, with_optimizer=want_optimizer, is_loading=True)
        for key in ("updates", "contents", "format"):
            sharded.pop(key)
        if not want_optimizer:
            sharded.pop("scheduler", None)
        loaded = _load_sharded(sharded, directory, model)
        for key, chunk in zip(_model_keys(model.chunks), model.chunks):
            unwrap_model(chunk).load_state_dict(loaded[key], strict=True)
        if want_optimizer:
            assert take_in is not None
            take_in(loaded["optimizer"])
            # Sets num_steps and the optimizer's lr/wd from the schedule, with the saved settings or this run's.
            model.scheduler.override_opt_param_scheduler = optim_from == "config"
            model.scheduler.use_checkpoint_opt_param_scheduler = optim_from != "config"
            if optim_from == "config":
                for group, values in zip(model.optimizer.param_groups, mine):
                    group.update(values)
            model.scheduler.load_state_dict(common["scheduler"])
            if hasattr(worker, "_updates"):
                worker._updates = int(common["updates"])
    return common


def model_state_writers(*, actor: Any = None, critic: Any = None, ref: Any = None) -> dict[str, Callable[[Path], None]]:
    """``CheckpointManager.save(writers=...)`` callbacks: one subdirectory per given worker.

    ``ref``: a reference model whose weights changed during the run (re-anchored after the SFT
    warm start); its weights only, since it has no optimizer.
    """
    workers = {"actor": actor, "critic": critic, "ref": ref}
    return {name: (lambda d, w=w: save_worker(d, w)) for name, w in workers.items() if w is not None}


def model_state_readers(
    *, actor: Any = None, critic: Any = None, ref: Any = None, load_optimizer: bool = True,
    optim_from: str = "checkpoint",
) -> dict[str, Callable[[Path], None]]:
    """``CheckpointManager.load(readers=...)`` callbacks matching :func:`model_state_writers`."""
    workers = {"actor": actor, "critic": critic, "ref": ref}
    return {
        name: (lambda d, w=w, n=name: load_worker(d, w, load_optimizer=load_optimizer and n != "ref", optim_from=optim_from))
        for name, w in workers.items()
        if w is not None
    }


__all__ = [
    "OPTIMIZER_SHARDING_TYPE",
    "load_worker",
    "model_state_readers",
    "model_state_writers",
    "save_worker",
]
