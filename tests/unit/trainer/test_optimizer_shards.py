"""The distributed optimizer's checkpoint: every DP rank writes and reads only its own shard (GPU review P3).

One spawned 2-rank group, a tiny Qwen2 with tied embeddings. At TP=1, DP=2 (each rank's distributed optimizer owns
half of every buffer) an actor takes one update and is saved by ``save_worker``; the same state is also saved the
way megatron-core 0.16 saves a ``fully_reshardable`` optimizer (gathered over gloo onto DP rank 0, which alone writes
it), as earlier checkpoints were. Then, into fresh actors:

* host memory: the bytes of the host tensors torch creates while ``load_worker`` runs (every op's fresh outputs,
  counted by a dispatch mode), with the optimizer minus without it (weights only), are about the rank's own share
  of the optimizer state, 12 bytes (fp32 param, exp_avg, exp_avg_sq) per parameter it owns; megatron-core's
  ``fully_reshardable`` load allocates the whole model's (its TP/PP shard's) 12 bytes per parameter on every rank;
* writes: each rank's ``.distcp`` files hold about half of the checkpoint (not DP rank 0 all of it);
* the loaded optimizer state is the saved one, bit for bit, from either checkpoint.

Another layout: an actor at PP=2, DP=1 (the tied embedding on both stages) is saved by ``save_worker`` and loaded at
PP=1, DP=2 both by ``load_worker`` and by megatron-core's own ``fully_reshardable`` load: the same optimizer state,
bit for bit (the pieces reshard across PP and DP as megatron's whole tensors do, and megatron reads them). Resume at
another TP is ``test_model_checkpoint``'s.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import VOCAB, make_batch

STATE_BYTES_PER_PARAM = 12  # fp32 main param + exp_avg + exp_avg_sq: what a checkpoint holds per parameter
MEGATRON_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
    "singleton_local_shards": False,
}
"""What ``model_checkpoint`` asked megatron-core for before P3."""


class HostAllocations(TorchDispatchMode):
    """Bytes of the fresh host tensors made by torch ops inside the mode (outputs that alias no input)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):  # views and in-place ops allocate nothing
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self.bytes += t.untyped_storage().nbytes()
        return out


def _tiny_tied(path: Path) -> Path:
    import transformers

    from tests.helpers.hf import redraw_weights, tiny_qwen2_config

    torch.manual_seed(0)
    model = redraw_weights(transformers.Qwen2ForCausalLM(tiny_qwen2_config(vocab=VOCAB, tied=True)).eval(), 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _actor(path: str, **parallel: int):
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig

    par = ParallelConfig(**parallel)
    layout = initialize_parallel(par, 2)
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                      optim=OptimConfig(lr=5e-3, lr_warmup_steps=0, clip_grad=1.0))
    return Actor(cfg, ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=4)


def _distributed_optimizer(actor) -> Any:
    optimizer = actor.model.optimizer
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    assert len(leaves) == 1 and type(leaves[0]).__name__ == "DistributedOptimizer"
    return leaves[0]


def _local_params(optimizer) -> list[tuple[Any, int]]:
    """This DP rank's parameters and how many of each one's elements it owns."""
    return [
        (param, len(ranges["param"]))
        for by_dtype in optimizer.gbuf_ranges
        for buckets in by_dtype.values()
        for bucket in buckets
        for param, ranges in bucket["param_map"].items()
    ]


def _optimizer_state(actor) -> list[dict[str, torch.Tensor]]:
    optimizer = _distributed_optimizer(actor)
    return [
        {k: v.detach().clone() for k, v in optimizer._get_main_param_and_optimizer_states(param).items()}
        for param, _ in _local_params(optimizer)
    ]


def _update(actor, seed: int) -> None:
    from mcore_agentic.feed.distribute import deal_rows

    full = make_batch(8, seed=seed)  # each DP replica its share, as the trainer deals them
    layout = actor.model.layout
    rows = deal_rows(full["attention_mask"].sum(1).tolist(), chunk=4, dp=layout.data_parallel_size, seed=None)
    actor.update_policy(actor.compute_log_prob(full.index(rows[layout.dp_rank])))


def _save_as_megatron_does(directory: Path, actor) -> None:
    """What ``save_worker`` wrote before P3: megatron-core's ``fully_reshardable``, gathered onto DP rank 0 (gloo)."""
    from megatron.core import dist_checkpointing

    from mcore_agentic.models.bridge import unwrap_model
    from mcore_agentic.trainer.model_checkpoint import FORMAT

    megatron = actor.model
    model = unwrap_model(megatron.chunks[0]).sharded_state_dict(metadata=MEGATRON_METADATA)
    state = {
        "model": model,
        "optimizer": megatron.optimizer.sharded_state_dict(model, is_loading=False, metadata=MEGATRON_METADATA),
        "scheduler": megatron.scheduler.state_dict(),
        "updates": actor._updates,
        "contents": ["model", "optimizer"],
        "format": FORMAT,
    }

    def drop_gathered(common: dict) -> dict:  # param_state is held by DP rank 0 only
        return {**common, "optimizer": {k: v for k, v in common["optimizer"].items() if k != "param_state"}}

    dist_checkpointing.save(state, str(directory), preprocess_common_before_consistancy_check=drop_gathered)


def _load_as_megatron_does(directory: Path, actor) -> None:
    """What ``load_worker`` did before P3 (megatron-core's ``fully_reshardable`` load), model and optimizer."""
    from megatron.core import dist_checkpointing

    from mcore_agentic.models.bridge import unwrap_model

    megatron = actor.model
    model = unwrap_model(megatron.chunks[0]).sharded_state_dict(metadata=MEGATRON_METADATA)
    optimizer = megatron.optimizer.sharded_state_dict(model, is_loading=True, metadata=MEGATRON_METADATA)
    loaded = dist_checkpointing.load({"model": model, "optimizer": optimizer}, str(directory))
    unwrap_model(megatron.chunks[0]).load_state_dict(loaded["model"], strict=True)
    megatron.optimizer.load_state_dict(loaded["optimizer"])


def _load_bytes(directory: Path, actor, **kwargs: Any) -> int:
    from mcore_agentic.trainer.model_checkpoint import load_worker

    with HostAllocations() as counter:
        load_worker(directory, actor, **kwargs)
    return counter.bytes


def _equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    same = (x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))
    return len(a) == len(b) and all(same)


def _body(rank: int, world_size: int, path: str, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import megatron_patches
    from mcore_agentic.parallel.layout import destroy_parallel
    from mcore_agentic.trainer.model_checkpoint import load_worker, save_worker

    megatron_patches.apply()
    new, old, pp2 = Path(root) / "new", Path(root) / "old", Path(root) / "pp2"
    if rank == 0:
        for d in (new, old, pp2):
            d.mkdir()
    dist.barrier()

    actor = _actor(path)
    _update(actor, seed=1)
    optimizer = _distributed_optimizer(actor)
    out: dict[str, Any] = {
        "own_params": sum(n for _, n in _local_params(optimizer)),
        "all_params": sum(b.numel_unpadded for b in optimizer.buffers),  # the whole model's (TP=PP=1)
    }
    saved = _optimizer_state(actor)
    save_worker(new, actor)
    _save_as_megatron_does(old, actor)
    dist.barrier()
    # torch_dist names a rank's files __<rank>_<writer thread>.distcp
    out["written_bytes"] = {r: sum(p.stat().st_size for p in new.glob(f"__{r}_*.distcp")) for r in range(world_size)}
    destroy_parallel()

    fresh = _actor(path)
    weights = _load_bytes(new, fresh, load_optimizer=False)
    out["optimizer_load_bytes"] = _load_bytes(new, fresh) - weights
    out["loaded_equal"] = _equal(_optimizer_state(fresh), saved)
    destroy_parallel()

    fresh = _actor(path)
    load_worker(old, fresh)
    out["old_loaded_equal"] = _equal(_optimizer_state(fresh), saved)
    destroy_parallel()

    actor = _actor(path, pipeline_model_parallel_size=2)
    _update(actor, seed=1)
    save_worker(pp2, actor)
    destroy_parallel()
    fresh = _actor(path)
    load_worker(pp2, fresh)
    ours = _optimizer_state(fresh)
    destroy_parallel()
    fresh = _actor(path)
    _load_as_megatron_does(pp2, fresh)
    out["resharded_as_megatron"] = _equal(ours, _optimizer_state(fresh))
    out["resharded_nonzero"] = all(bool(s["exp_avg_sq"].abs().sum() > 0) for s in ours)
    destroy_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("optimizer_shards")
    path = _tiny_tied(tmp / "tiny")
    return run_distributed(_body, 2, args=(str(path), str(tmp)))


def test_a_load_allocates_the_ranks_own_optimizer_state_not_the_whole_models(runs):
    for out in runs:
        own = STATE_BYTES_PER_PARAM * out["own_params"]
        whole = STATE_BYTES_PER_PARAM * out["all_params"]
        assert out["own_params"] <= 0.55 * out["all_params"]  # DP=2: each rank owns about half
        assert out["optimizer_load_bytes"] <= 1.1 * own, (out["optimizer_load_bytes"], own, whole)


def test_every_rank_writes_its_own_part(runs):
    written = runs[0]["written_bytes"]
    total = sum(written.values())
    assert all(size >= 0.35 * total for size in written.values()), written


def test_the_loaded_optimizer_state_is_the_saved_one(runs):
    for out in runs:
        assert out["loaded_equal"]


def test_a_checkpoint_saved_by_megatrons_gather_still_loads(runs):
    """Checkpoints written before P3 (megatron-core's fully_reshardable, one writer) resume into the same state."""
    for out in runs:
        assert out["old_loaded_equal"]


def test_a_pp2_checkpoint_loads_at_dp2_as_megatron_loads_it(runs):
    for out in runs:
        assert out["resharded_nonzero"]  # Adam's moments after one update, not a fresh optimizer's zeros
        assert out["resharded_as_megatron"]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 6), ()])
def test_flat_boxes_cover_a_flat_range_exactly(shape):
    from mcore_agentic.trainer.optimizer_shards import flat_boxes

    numel = math.prod(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        covered = torch.zeros(shape, dtype=torch.int64)
        flat = torch.arange(numel).reshape(shape)
        got = []
        boxes = flat_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        for offset, size in boxes:
            box = tuple(slice(o, o + s) for o, s in zip(offset, size))
            covered[box] += 1
            got += flat[box].reshape(-1).tolist()
        assert got == list(range(start, stop)), (shape, start, stop)  # in order, each element once
        assert int(covered.sum()) == stop - start
