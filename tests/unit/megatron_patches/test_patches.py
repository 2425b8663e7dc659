"""Each megatron patch is needed (the operation fails with it reverted) and works (with it applied).

One 2-rank gloo job runs a probe per patch twice — with only that patch reverted
(the probe must raise, or for the two patches whose bug is silent give the wrong
answer) and with it applied (the probe must give the right answer) — and returns
everything; the tests below read that record. Probes fail *before* any collective
when unpatched (or fail on every rank at the same point), so a failing rank never
leaves its peer waiting.
"""

from __future__ import annotations

import io
import os
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import megatron_patches
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack


def _init(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep,
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


def _ddp_linear(use_distributed_optimizer: bool, dtype: torch.dtype = torch.float32):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=True), torch.nn.Linear(6, 2, bias=False)).to(dtype)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16)
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


def probe_save_results_in_process(tmp_dir: str) -> dict[str, Any]:
    """The dist-ckpt probe's save and load, and the processes the save started that outlive it."""
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    loaded = probe_dist_checkpointing_devices(tmp_dir)
    started = [p.name for p in multiprocessing.active_children() if p.pid not in before]
    return {"loaded": loaded, "started": started}


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


class _Planted:
    """Unpickling it creates ``target``: stands for any code a pickle planted in a shard would run."""

    def __init__(self, target: str):
        self.target = Path(target)

    def __reduce__(self):
        return (Path.touch, (self.target,))


def probe_dist_checkpointing_weights_only(tmp_dir: str) -> dict[str, Any]:
    """Byte entries: a clean one (TE-style ``io.BytesIO`` extra state) and a planted pickle, saved by megatron."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject
    from torch.distributed.checkpoint.api import CheckpointException

    _init(tp=1)
    rank = dist.get_rank()
    ran = os.path.join(tmp_dir, "code_ran")

    def obj(key: str, data: Any) -> ShardedObject:
        return ShardedObject(key, data, (1,), (0,), replica_id=rank)

    os.makedirs(tmp_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"extra": obj("extra", io.BytesIO(b"te extra state")), "planted": obj("planted", _Planted(ran))}, tmp_dir)
    extra = dist_checkpointing.load({"extra": obj("extra", None)}, tmp_dir)["extra"]
    try:
        dist_checkpointing.load({"planted": obj("planted", None)}, tmp_dir)
        refused = None
    except CheckpointException as exc:  # every rank's failure, gathered by torch.distributed.checkpoint
        refused = str(exc.failures)[:2000]
    dist.barrier()
    return {"extra": extra.getvalue(), "refused": refused, "code_ran": os.path.exists(ran)}


_DISTOPT_METADATA = {  # megatron-core's own fully_reshardable path (the checkpoints before optimizer_shards)
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}


def _distopt_adam():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _config, model = _ddp_linear(use_distributed_optimizer=True)  # same init on every call
    config = OptimizerConfig(optimizer="adam", lr=0.1, use_distributed_optimizer=True, params_dtype=torch.float32)
    return model, get_megatron_optimizer(config, [model])


def _model_sharded(model) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor

    dp_rank = parallel_state.get_data_parallel_rank()
    return {n: ShardedTensor.from_rank_offsets(f"m.{n}", p, replica_id=dp_rank) for n, p in model.module.named_parameters()}


def _adam_step(model, optimizer, seed: int) -> None:
    x = torch.full((5, 4), float(dist.get_rank() + seed), dtype=next(model.module.parameters()).dtype)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(x).sum().backward()
    model.finish_grad_sync()
    optimizer.step()


def _adam_steps(optimizer) -> list[torch.Tensor]:
    return [s["step"] for opt in optimizer.chained_optimizers for s in opt.optimizer.state.values()]


def _drop_gathered_param_state(common: dict[str, Any]) -> dict[str, Any]:
    optimizer = common.get("optimizer")  # the fully-reshardable param_state is gathered on DP rank 0 only
    if isinstance(optimizer, dict) and "param_state" in optimizer:
        return {**common, "optimizer": {k: v for k, v in optimizer.items() if k != "param_state"}}
    return common


def _save_then_load(make: Any, tmp_dir: str) -> tuple[Any, ...]:
    """A reference ``make()`` pair (model, optimizer) takes a step and is saved (fully reshardable) to ``tmp_dir``,
    then takes a second step; a fresh pair loads the checkpoint (it has not taken the second step yet). Returns the
    reference pair, the reference's parameters at the save, and the loaded pair."""
    from megatron.core import dist_checkpointing

    ref_model, ref_opt = make()
    _adam_step(ref_model, ref_opt, seed=1)
    os.makedirs(tmp_dir, exist_ok=True)
    dist.barrier()
    saved = {"model": _model_sharded(ref_model), "optimizer": ref_opt.sharded_state_dict(
        _model_sharded(ref_model), metadata=_DISTOPT_METADATA)}
    dist_checkpointing.save(saved, tmp_dir, preprocess_common_before_consistancy_check=_drop_gathered_param_state)
    first = [p.detach().clone() for p in ref_model.module.parameters()]
    _adam_step(ref_model, ref_opt, seed=2)

    model, opt = make()
    target = {"model": _model_sharded(model), "optimizer": opt.sharded_state_dict(
        _model_sharded(model), is_loading=True, metadata=_DISTOPT_METADATA)}
    loaded = dist_checkpointing.load(target, tmp_dir)
    with torch.no_grad():
        for name, param in model.module.named_parameters():
            param.copy_(loaded["model"][name])
    opt.load_state_dict(loaded["optimizer"])
    return ref_model, ref_opt, first, model, opt


def probe_distopt_load(tmp_dir: str) -> dict[str, Any]:
    """Resume a torch-Adam distributed optimizer (megatron-core's fully reshardable path) in a fresh one.

    The reference takes one step, is saved, and takes a second; a fresh (never-stepped) model and
    optimizer load the checkpoint and take the same second step.
    """

    _init(tp=1)
    ref_model, ref_opt, _first, model, opt = _save_then_load(_distopt_adam, tmp_dir)
    steps = _adam_steps(opt)
    shared_step = len({id(s) for s in steps}) < len(steps)
    _adam_step(model, opt, seed=2)
    return {
        "shared_step": shared_step,
        "steps": [float(s) for s in _adam_steps(opt)],
        "ref_steps": [float(s) for s in _adam_steps(ref_opt)],
        "params": [p.detach().clone() for p in model.module.parameters()],
        "ref_params": [p.detach().clone() for p in ref_model.module.parameters()],
    }


def _hybrid_adam():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _config, model = _ddp_linear(use_distributed_optimizer=True, dtype=torch.bfloat16)
    config = OptimizerConfig(optimizer="adam", lr=0.1, bf16=True, params_dtype=torch.bfloat16,
                             use_distributed_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                             use_precision_aware_optimizer=True, pin_cpu_grads=False, pin_cpu_params=False)
    return model, get_megatron_optimizer(config, [model])


def probe_hybrid_optimizer(tmp_dir: str) -> dict[str, Any]:
    """The CPU-offloaded optimizer (bf16 model, all of its state on the host) steps, is saved, and a fresh one resumes
    it: the resumed second step equals the uninterrupted one."""
    _init(tp=1)
    ref_model, _ref_opt, first, model, opt = _save_then_load(_hybrid_adam, tmp_dir)
    _adam_step(model, opt, seed=2)
    return {
        "first": first,
        "params": [p.detach().clone() for p in model.module.parameters()],
        "ref_params": [p.detach().clone() for p in ref_model.module.parameters()],
    }


def probe_moe() -> torch.Tensor:
    """A one-layer MoE GPT (4 experts, top-2, all-to-all dispatcher) at EP=2: each rank holds two experts and
    routes its own tokens (different on each rank) through both ranks' experts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.unit.megatron_patches._tiny_gpt import transformer_config

    _init(ep=2)
    _seed()
    cfg = transformer_config(
        num_layers=1, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=2, use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                     position_embedding_type="rope")
    ids = (torch.arange(8) * (dist.get_rank() + 3) % 64).reshape(1, 8)
    with torch.no_grad():
        return model(ids, torch.arange(8).reshape(1, 8), attention_mask=None)


def probe_checkpoint_without_output() -> torch.Tensor:
    """Selective recomputation's checkpoint that drops its output (``recompute_modules`` layernorm and mlp): the
    forward, the output discarded, then recomputed in the backward pass; returns the input's gradient."""
    from megatron.core import tensor_parallel

    x = torch.linspace(-2, 2, 12, requires_grad=True)
    checkpoint = tensor_parallel.CheckpointWithoutOutput()
    y = checkpoint.checkpoint(torch.nn.functional.silu, x)
    z = y * 3
    checkpoint.discard_output_and_register_recompute(z)
    z.sum().backward()
    return x.grad


def _probe_table(tmp_root: str) -> dict[str, tuple[str, Callable[[], Any]]]:
    """patch name -> (probe label, probe). Each call to a dist-ckpt probe needs a fresh directory."""
    dirs = iter(os.path.join(tmp_root, f"ckpt{i}") for i in range(32))  # same paths on every rank
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
        "moe_devices": ("moe", probe_moe),
        "moe_dispatch_splits": ("moe", probe_moe),
        "moe_router_gemm_without_te": ("moe", probe_moe),
        "checkpoint_without_output_fp8": ("ckpt_no_output", probe_checkpoint_without_output),
        "dist_checkpointing_weights_only": ("ckpt_bytes", lambda: probe_dist_checkpointing_weights_only(next(dirs))),
        "distopt_load_unstepped": ("distopt_load", lambda: probe_distopt_load(next(dirs))),
        "distopt_load_step_key": ("distopt_load", lambda: probe_distopt_load(next(dirs))),
        "distopt_load_shared_step": ("distopt_load", lambda: probe_distopt_load(next(dirs))),
        "save_results_in_process": ("ckpt_procs", lambda: probe_save_results_in_process(next(dirs))),
        "hybrid_optimizer_devices": ("hybrid", lambda: probe_hybrid_optimizer(next(dirs))),
        "te_version_without_te": ("hybrid", lambda: probe_hybrid_optimizer(next(dirs))),
        "hybrid_optimizer_state_dict": ("hybrid", lambda: probe_hybrid_optimizer(next(dirs))),
    }


def _failure(exc: BaseException) -> dict[str, Any]:
    """What a probe's failure was and which modules its traceback ran through."""
    import traceback

    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return {
        "error": f"{type(exc).__name__}: {exc}"[:300],
        "modules": [frame.f_globals.get("__name__", "") for frame in frames],
        "functions": [frame.f_code.co_name for frame in frames],
    }


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
            record[f"{name}/without_result"] = probe()  # silent bugs: a wrong answer instead of an error
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


# The failure each probe must show without its patch. Default: CPU tensors reaching megatron-core's CUDA-only code.
_EXPECTED_FAILURE = {
    "rope_cp_slice": "RuntimeError: pin_memory=True requires a CUDA",
    "clip": "AssertionError",
    "distopt_load_unstepped": "AssertionError: ",  # state_dict(): assert len(steps) == 1, over no per-param steps
    "distopt_load_step_key": "KeyError: 'step'",
    "moe_devices": "RuntimeError: torch.cuda.Stream requires CUDA support",
    "moe_dispatch_splits": "TypeError: all_to_all_single(): incompatible function arguments",
    "moe_router_gemm_without_te": "NameError: name 'te_general_gemm' is not defined",
    "checkpoint_without_output_fp8": "NameError: name 'FP8GlobalStateManager' is not defined",
    "te_version_without_te": "TypeError: '>=' not supported between instances of 'NoneType' and 'Version'",
}
# ... raised in this function (when the module alone does not pin it down).
_EXPECTED_FUNCTION = {
    "distopt_load_unstepped": "state_dict",
    "distopt_load_step_key": "_set_main_param_and_optimizer_states",
}
# Patches whose bug gives a wrong answer, not an error: their own tests below read "<name>/without_result".
_SILENT = ("dist_checkpointing_weights_only", "distopt_load_shared_step", "save_results_in_process",
           "hybrid_optimizer_state_dict")  # its failure is at load, in megatron's reader: its own test below


@pytest.mark.parametrize("name", [*(n for n in megatron_patches.PATCH_NAMES if n not in _SILENT), "clip"])
def test_probe_fails_without_patch_where_the_patch_acts(records, name):
    expected = _EXPECTED_FAILURE.get(name, "AssertionError: Torch not compiled with CUDA enabled")
    for rank, rec in enumerate(records):
        failure = rec[f"{name}/without"]
        assert failure is not None, f"rank {rank}: {name} probe passed with the patch reverted"
        assert failure["error"].startswith(expected), (name, failure["error"])
        # ... raised inside a module whose names the patch rebinds, not somewhere unrelated
        targets = rec[f"{name}/targets"]
        assert set(failure["modules"]) & set(targets), (name, targets, failure["modules"][-6:])
        if name in _EXPECTED_FUNCTION:
            assert failure["functions"][-1] == _EXPECTED_FUNCTION[name], (name, failure["functions"][-6:])


def test_the_host_optimizer_resumes_its_update_exactly(records):
    for rec in records:
        out = rec["hybrid_optimizer_devices/with"]
        assert any(not torch.equal(a, b) for a, b in zip(out["first"], out["ref_params"]))  # the second step moved
        for got, want in zip(out["params"], out["ref_params"], strict=True):
            assert torch.equal(got, want)


def test_a_host_optimizer_checkpoint_loads_weights_only(records):
    for rec in records:
        failure = rec["hybrid_optimizer_state_dict/without"]
        assert failure is not None and failure["error"].startswith("UnpicklingError: Weights only load failed"), failure
        assert "torch.load_state_dict" not in failure["functions"] and "load_common" in failure["functions"]
        out = rec["hybrid_optimizer_state_dict/with"]
        assert all(torch.equal(a, b) for a, b in zip(out["params"], out["ref_params"], strict=True))


def test_checkpoint_without_output_recomputes_the_exact_gradient(records):
    x = torch.linspace(-2, 2, 12, requires_grad=True)
    (3 * torch.nn.functional.silu(x)).sum().backward()
    for rec in records:
        torch.testing.assert_close(rec["checkpoint_without_output_fp8/with"], x.grad, rtol=0, atol=0)


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


def test_byte_entries_of_dist_checkpoints_load_weights_only(records):
    for rec in records:
        without = rec["dist_checkpointing_weights_only/without_result"]
        assert without["refused"] is None and without["code_ran"]  # torch unpickles the planted bytes: code runs
        with_patch = rec["dist_checkpointing_weights_only/with"]
        assert with_patch["refused"] is not None and "Weights only load failed" in with_patch["refused"]
        assert not with_patch["code_ran"]
        assert with_patch["extra"] == b"te extra state"  # the byte entries megatron-core writes still load


def test_distopt_resume_into_a_fresh_optimizer_is_bitwise(records):
    """All three distopt_load_* patches on: the resumed step equals the uninterrupted one, bit for bit."""
    for name in ("distopt_load_unstepped", "distopt_load_step_key", "distopt_load_shared_step"):
        for rec in records:
            got = rec[f"{name}/with"]
            assert not got["shared_step"]
            assert got["steps"] == got["ref_steps"] == [2.0] * len(got["steps"])
            assert all(torch.equal(a, b) for a, b in zip(got["params"], got["ref_params"], strict=True))


def test_distopt_step_is_shared_after_a_load_without_the_patch(records):
    """Without distopt_load_shared_step: one step tensor for all parameters, advanced once per parameter."""
    wrong_step = wrong_param = False
    for rec in records:
        without = rec["distopt_load_shared_step/without_result"]
        n = len(without["steps"])
        assert without["shared_step"] or n == 1
        assert without["steps"] == [1.0 + n] * n  # loaded at 1, then +1 for each of this rank's n parameters
        wrong_step |= n > 1
        wrong_param |= not all(torch.equal(a, b) for a, b in zip(without["params"], without["ref_params"], strict=True))
    assert wrong_step and wrong_param  # some rank holds two parameters: a wrong bias correction, other weights


def test_a_save_starts_no_manager_process_and_writes_the_same_checkpoint(records):
    """Without save_results_in_process the first save spawns megatron's multiprocessing Manager, which outlives
    it; with the patch no process outlives a save, and the checkpoint loads the same values."""
    for rank, rec in enumerate(records):
        without, with_patch = rec["save_results_in_process/without_result"], rec["save_results_in_process/with"]
        assert [name.split("-")[0] for name in without["started"]] == ["SyncManager"], without["started"]
        assert with_patch["started"] == []
        other = (rank + 1) % len(records)
        expected = torch.arange(4, dtype=torch.float32) + 4 * other
        assert torch.equal(without["loaded"], expected) and torch.equal(with_patch["loaded"], expected)


def test_device_independent_patches_are_exactly_the_ones_applied_with_cuda(monkeypatch):
    not_cpu_only = tuple(n for n in megatron_patches.PATCH_NAMES if not megatron_patches.get_patch(n).cpu_only)
    assert not_cpu_only == megatron_patches.DEVICE_INDEPENDENT_PATCH_NAMES
    assert set(megatron_patches.CHECKPOINT_PATCH_NAMES) < set(not_cpu_only)
    assert megatron_patches.CHECKPOINT_PATCH_NAMES == (
        "dist_checkpointing_weights_only", "distopt_load_unstepped", "distopt_load_step_key", "distopt_load_shared_step")
    before = megatron_patches.applied()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        added = [n for n in megatron_patches.apply() if n not in before]
    finally:
        megatron_patches.revert([n for n in megatron_patches.applied() if n not in before])
    assert added == [n for n in megatron_patches.DEVICE_INDEPENDENT_PATCH_NAMES if n not in before]
    assert megatron_patches.applied() == before


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


def test_moe_layer_runs_at_expert_parallel_2(records):
    for rec in records:
        out = rec["moe_devices/with"]
        assert out.shape == (1, 8, 64) and torch.isfinite(out).all()
    # Each rank routed its own tokens: the logits differ, and both ranks' experts took part (EP=2 all-to-all).
    assert not torch.equal(records[0]["moe_devices/with"], records[1]["moe_devices/with"])

