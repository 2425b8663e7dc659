"""Each CPU/gloo patch is needed (the operation fails with it reverted) and works (with it applied).

One 2-rank gloo job runs a probe per patch twice — with only that patch reverted
(the probe must raise) and with it applied (the probe must give the right
answer) — and returns everything; the tests below read that record. Probes fail
*before* any collective when unpatched, so a failing rank never leaves its peer
waiting.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import megatron_patches
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack


def _init(tp: int = 1, pp: int = 1, cp: int = 1) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )


def _seed() -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(7)


# --- probes: each returns a picklable result, or raises -------------------------------------------------------------


def probe_rng_tracker() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    _init(tp=2)
    _seed()
    torch.manual_seed(0)
    plain = torch.rand(4)
    torch.manual_seed(0)
    with get_cuda_rng_tracker().fork():
        tp_stream = torch.rand(4)
    after_fork = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        tp_stream_next = torch.rand(4)
    return {"plain": plain, "after_fork": after_fork, "tp": tp_stream, "tp_next": tp_stream_next}


def probe_tensor_parallel_devices() -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    _init(tp=2)
    x = torch.full((2, 3), float(dist.get_rank()))
    return gather_from_sequence_parallel_region(x)


def probe_transformer_devices() -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    _init(tp=2)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    return rope(6)


def probe_pipeline_p2p() -> torch.Tensor:
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    _init(pp=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    mine = torch.full((3, 1, 4), float(dist.get_rank()) + 10.0)
    # PP=2 ring: each stage sends to "next" and receives from "prev", i.e. the two ranks swap tensors.
    return comm.send_forward_recv_forward(mine, recv_prev=True, tensor_shape=(3, 1, 4))


def _ddp_linear(use_distributed_optimizer: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=True), torch.nn.Linear(6, 2, bias=False))
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=torch.float32)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer, bucket_size=None
    )
    return config, DistributedDataParallel(config, ddp_config, module)


def probe_ddp_buffers() -> dict[str, torch.Tensor]:
    _init(tp=1)
    _config, model = _ddp_linear(use_distributed_optimizer=False)
    x = torch.full((5, 4), float(dist.get_rank() + 1))
    model(x).sum().backward()
    model.finish_grad_sync()
    first = next(model.module.parameters())
    return {"main_grad": first.main_grad.clone(), "param": first.detach().clone()}


def probe_optimizer_devices() -> dict[str, Any]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _init(tp=1)
    _config, model = _ddp_linear(use_distributed_optimizer=True)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.1, use_distributed_optimizer=True, clip_grad=1e-3, params_dtype=torch.float32),
        [model],
    )
    before = [p.detach().clone() for p in model.module.parameters()]
    x = torch.full((5, 4), float(dist.get_rank() + 1))
    model.zero_grad_buffer()
    opt.zero_grad()
    model(x).sum().backward()
    model.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    after = [p.detach().clone() for p in model.module.parameters()]
    return {"ok": ok, "grad_norm": grad_norm, "before": before, "after": after}


def probe_clip_grads() -> torch.Tensor:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=8.0)
    return p.grad


def probe_rerun_state_machine() -> list[bool]:
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    _init(tp=1)
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    runs = []
    while (go := machine.should_run_forward_backward(None)) and len(runs) < 3:
        runs.append(go)
    return runs + [go]


def probe_parallel_state_sync() -> bool:
    from megatron.core import parallel_state

    _init(tp=1)
    parallel_state.update_pg_timeout(timedelta(minutes=5))
    return True


def probe_dist_checkpointing_devices(tmp_dir: str) -> torch.Tensor:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    _init(tp=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = torch.arange(4, dtype=torch.float32) + 4 * rank
    sd = {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}
    os.makedirs(tmp_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, tmp_dir)
    # Load the *other* rank's shard: the bytes must come from the checkpoint, not memory.
    other = (rank + 1) % world
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, other, world))}
    return dist_checkpointing.load(target, tmp_dir)["w"]


def probe_rope_cp_slice() -> torch.Tensor:
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    _init(cp=2)
    emb = torch.arange(8, dtype=torch.float32).view(8, 1, 1, 1)
    return get_pos_emb_on_this_cp_rank(emb, 0, parallel_state.get_context_parallel_group()).flatten()


def probe_tied_embedding_sync() -> torch.Tensor:
    from megatron.core import parallel_state

    from tests.unit.megatron_patches import _tiny_gpt as T

    _init(pp=2)
    _seed()
    model = T.build_gpt(T.transformer_config(), share_embeddings_and_output_weights=True)
    assert parallel_state.get_pipeline_model_parallel_world_size() == 2
    # First stage: the input embedding; last stage: its copy, used as the output layer.
    return model.shared_embedding_or_output_weight().detach().clone()


def _probe_table(tmp_root: str) -> dict[str, tuple[str, Callable[[], Any]]]:
    """patch name -> (probe label, probe). Each call to a dist-ckpt probe needs a fresh directory."""
    dirs = iter(os.path.join(tmp_root, f"ckpt{i}") for i in range(4))  # same paths on every rank
    return {
        "rng_tracker": ("rng", probe_rng_tracker),
        "tensor_parallel_devices": ("gather", probe_tensor_parallel_devices),
        "transformer_devices": ("rope", probe_transformer_devices),
        "pipeline_p2p": ("p2p", probe_pipeline_p2p),
        "ddp_buffers": ("ddp", probe_ddp_buffers),
        "optimizer_devices": ("distopt", probe_optimizer_devices),
        "rerun_state_machine": ("rerun", probe_rerun_state_machine),
        "parallel_state_sync": ("pg_timeout", probe_parallel_state_sync),
        "dist_checkpointing_devices": ("ckpt", lambda: probe_dist_checkpointing_devices(next(dirs))),
        "rope_cp_slice": ("rope_cp", probe_rope_cp_slice),
        "tied_embedding_sync": ("tied", probe_tied_embedding_sync),
    }


def _failure(exc: BaseException) -> dict[str, Any]:
    """What a probe's failure was and which modules its traceback ran through."""
    import traceback

    modules = [frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return {"error": f"{type(exc).__name__}: {exc}"[:300], "modules": modules}


def _targets(name: str) -> list[str]:
    """Modules whose names (module globals, functions, classes) the active patch ``name`` rebinds."""
    owners = [owner for owner, _attr, _old in megatron_patches._ACTIVE[name].swaps]
    return sorted({o.__name__ if isinstance(o, types.ModuleType) else getattr(o, "__module__", "") for o in owners})


def _all_probes(rank: int, world_size: int, tmp_root: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    # Tensor allocations on CPU by the rng probe need the tracker etc.; start from everything applied.
    megatron_patches.apply()
    record: dict[str, Any] = {"applied": megatron_patches.applied()}
    for name, (_label, probe) in _probe_table(tmp_root).items():
        record[f"{name}/targets"] = _targets(name)
        megatron_patches.revert([name])
        try:
            probe()
            record[f"{name}/without"] = None
        except Exception as exc:  # noqa: BLE001 - the failure is the observation
            record[f"{name}/without"] = _failure(exc)
        megatron_patches.apply([name])
        dist.barrier()
        record[f"{name}/with"] = probe()
        dist.barrier()
    # Extra: clip_grad_by_total_norm_fp32 is part of optimizer_devices; check it on its own too.
    record["clip/targets"] = _targets("optimizer_devices")
    megatron_patches.revert(["optimizer_devices"])
    try:
        probe_clip_grads()
        record["clip/without"] = None
    except Exception as exc:  # noqa: BLE001
        record["clip/without"] = _failure(exc)
    megatron_patches.apply(["optimizer_devices"])
    record["clip/with"] = probe_clip_grads()
    record["after_revert_all"] = (megatron_patches.revert(), megatron_patches.applied())[1]
    parallel_state.destroy_model_parallel()
    return pack(record)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict[str, Any]]:
    if torch.cuda.is_available():
        pytest.skip("CPU/gloo patches are no-ops with CUDA")
    return [unpack(r) for r in run_distributed(_all_probes, 2, args=(str(tmp_path_factory.mktemp("ckpt")),))]


# The failure each probe must show without its patch: CPU tensors reaching megatron-core's CUDA-only code.
_EXPECTED_FAILURE = {"rope_cp_slice": "RuntimeError: pin_memory=True requires a CUDA", "clip": "AssertionError"}


@pytest.mark.parametrize("name", [*megatron_patches.PATCH_NAMES, "clip"])
def test_probe_fails_without_patch_where_the_patch_acts(records, name):
    expected = _EXPECTED_FAILURE.get(name, "AssertionError: Torch not compiled with CUDA enabled")
    for rank, rec in enumerate(records):
        failure = rec[f"{name}/without"]
        assert failure is not None, f"rank {rank}: {name} probe passed with the patch reverted"
        assert failure["error"].startswith(expected), (name, failure["error"])
        # ... raised inside a module whose names the patch rebinds, not somewhere unrelated
        targets = rec[f"{name}/targets"]
        assert set(failure["modules"]) & set(targets), (name, targets, failure["modules"][-6:])


def test_rng_tracker_forks_cpu_generator(records):
    r0, r1 = records[0]["rng_tracker/with"], records[1]["rng_tracker/with"]
    for rec in (r0, r1):
        # The fork does not consume or disturb the default stream ...
        assert torch.equal(rec["after_fork"], rec["plain"])
        # ... it draws from its own stream, which continues across forks.
        assert not torch.equal(rec["tp"], rec["plain"])
        assert not torch.equal(rec["tp_next"], rec["tp"])
    # TP ranks get different model-parallel streams (seed + 2718 + tp_rank).
    assert not torch.equal(r0["tp"], r1["tp"])


def test_tensor_parallel_gather(records):
    expected = torch.cat([torch.zeros(2, 3), torch.ones(2, 3)])
    for rec in records:
        assert torch.equal(rec["tensor_parallel_devices/with"], expected)


def test_transformer_rope_on_cpu(records):
    emb = records[0]["transformer_devices/with"]
    assert emb.device.type == "cpu" and emb.shape == (6, 1, 1, 8)
    assert torch.allclose(emb[3, 0, 0, 0], torch.tensor(3.0))  # position 3 * inv_freq[0] (= 1)


def test_pipeline_p2p_swaps_tensors(records):
    assert torch.equal(records[0]["pipeline_p2p/with"], torch.full((3, 1, 4), 11.0))
    assert torch.equal(records[1]["pipeline_p2p/with"], torch.full((3, 1, 4), 10.0))


def test_ddp_grads_are_averaged(records):
    g0, g1 = records[0]["ddp_buffers/with"]["main_grad"], records[1]["ddp_buffers/with"]["main_grad"]
    assert torch.equal(g0, g1) and g0.abs().sum() > 0


def test_distributed_optimizer_step(records):
    r0, r1 = records[0]["optimizer_devices/with"], records[1]["optimizer_devices/with"]
    assert r0["ok"] and r1["ok"] and r0["grad_norm"] == pytest.approx(r1["grad_norm"])
    for b, a0, a1 in zip(r0["before"], r0["after"], r1["after"]):
        assert torch.equal(a0, a1), "replicas diverged after the distributed-optimizer all-gather"
        assert not torch.equal(a0, b), "parameters did not change"


def test_clip_grads(records):
    for rec in records:
        assert rec["clip/without"] is not None
        assert torch.allclose(rec["clip/with"], torch.full((3,), 4.0 / (8.0 + 1e-6)))


def test_rerun_state_machine_validate_mode(records):
    assert records[0]["rerun_state_machine/with"] == [True, False]


def test_dist_checkpoint_round_trip(records):
    assert torch.equal(records[0]["dist_checkpointing_devices/with"], torch.arange(4.0) + 4)
    assert torch.equal(records[1]["dist_checkpointing_devices/with"], torch.arange(4.0))


def test_rope_cp_slice(records):
    assert torch.equal(records[0]["rope_cp_slice/with"], torch.tensor([0.0, 1.0, 6.0, 7.0]))
    assert torch.equal(records[1]["rope_cp_slice/with"], torch.tensor([2.0, 3.0, 4.0, 5.0]))


def test_tied_embedding_copies_equal_across_stages(records):
    first, last = records[0]["tied_embedding_sync/with"], records[1]["tied_embedding_sync/with"]
    assert torch.equal(first, last) and first.abs().sum() > 0


def test_apply_is_explicit_idempotent_and_revertible(records):
    assert records[0]["applied"] == megatron_patches.PATCH_NAMES
    assert records[0]["after_revert_all"] == ()


def test_nothing_applied_on_import():
    assert megatron_patches.applied() == ()


def test_unknown_patch_name():
    with pytest.raises(ValueError, match="unknown megatron patch 'nope'"):
        megatron_patches.apply(["nope"], force=True)


def test_a_missing_target_is_an_error_listing_it_and_nothing_stays_patched(monkeypatch):
    import types

    import megatron_patches
    from megatron_patches._base import Patch

    holder = types.SimpleNamespace(__name__="holder", present=1)

    def install(ctx):
        ctx.swap(holder, "present", 2)  # done first, undone when the patch turns out incomplete
        ctx.swap(holder, "renamed_in_a_later_version", 3)
        ctx.swap_in("megatron.core.no_such_module", "anything", lambda old: old)

    monkeypatch.setattr(megatron_patches, "get_patch", lambda name: Patch(name, "test", install))
    with pytest.raises(megatron_patches.MissingPatchTargets) as err:
        megatron_patches.apply(["half_a_patch"], force=True)
    message = str(err.value)
    assert "half_a_patch: holder.renamed_in_a_later_version, megatron.core.no_such_module" in message
    assert "tested on megatron-core 0.16.1" in message
    assert holder.present == 1 and "half_a_patch" not in megatron_patches.applied()
