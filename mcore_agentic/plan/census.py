"""What one rank of a layout holds, counted by megatron-core itself: the model built on the meta device.

For each rank asked about, a world of ``world_size`` ranks is made of torch's ``fake`` process groups (no
communication, one process), Megatron's parallel state is initialised with the layout's sizes, and the bridge
builds the rank's model chunks exactly as :class:`~mcore_agentic.workers.megatron_model.MegatronModel` does — on the
``meta`` device, so a 30B model costs no memory. Megatron's DDP then lays out its parameter and gradient buffers
(its padding rules), and the distributed optimizer's own range map says which slice of each buffer this rank's
optimizer owns. Nothing here restates a shape or a sharding rule: the bytes are those of the build.

It runs in a child process (:func:`run_census`; one per process, kept for later questions until
:func:`shutdown_census`): the fake world must not meet the caller's process groups, and
on a machine without CUDA the CPU patches (``megatron_patches``) stand in for megatron-core's CUDA allocations,
redirected to the meta device. ``python -m mcore_agentic.plan.census`` reads a JSON request on stdin and writes
the answer on stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from mcore_agentic.utils.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RankState:
    """The trainable model's resident state on one rank, in bytes, as megatron-core allocates it."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    ep_rank: int
    params: int
    """Parameters of this rank's chunks (elements, unpadded)."""
    expert_params: int
    """Of :attr:`params`, those of routed experts (held by one expert-parallel rank)."""
    param_bytes: int
    """DDP's contiguous parameter buffers (padded), in the model dtype."""
    grad_bytes: int
    """DDP's gradient buffers (padded; fp32: ``grad_reduce_in_fp32``)."""
    main_param_bytes: int
    """The distributed optimizer's fp32 master copy of this rank's shard (0 for an fp32 model: it trains the
    parameters in place)."""
    optimizer_bytes: int
    """Adam's two fp32 moments over this rank's shard (the whole model without the distributed optimizer)."""
    frozen_param_bytes: int
    """The same chunks without DDP (a reference or teacher: no padding, no gradients)."""


def stage_ranks(world_size: int, pipeline_model_parallel_size: int) -> list[int]:
    """The first rank of each pipeline stage: the ranks a plan looks at. Megatron orders ranks tp-cp-ep-dp-pp, so
    a stage is a contiguous block of ``world_size / PP`` ranks; the ranks of one stage hold the same amount but
    for the distributed optimizer's buffer padding (a few elements on the last DP rank)."""
    return [stage * (world_size // pipeline_model_parallel_size) for stage in range(pipeline_model_parallel_size)]


def _census_here(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The census in this process (the child): one :class:`RankState` per requested rank."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch
    import torch.distributed as dist

    import megatron_patches  # the child builds as the launcher does
    import megatron_patches._cpu_torch as cpu_torch

    megatron_patches.apply()
    cpu_torch._CPU = torch.device("meta")  # megatron-core's "CUDA" allocations (DDP buffers, RoPE) on meta
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig

    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import megatron_sizes

    hf = dict(request["hf_config"])
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    parallel = ParallelConfig(**request["parallel"])
    dtype = getattr(torch, request["dtype"])
    distributed_optimizer = bool(request.get("use_distributed_optimizer", True))
    bridge = get_bridge(hf_config, make_vocab_size_divisible_by=int(request.get("make_vocab_size_divisible_by", 128)),
                        lm_head=bool(request.get("lm_head", True)))
    world = int(request["world_size"])
    out = []
    for rank in request["ranks"]:
        dist.init_process_group("fake", store=FakeStore(), rank=int(rank), world_size=world)
        try:
            parallel_state.initialize_model_parallel(**megatron_sizes(parallel), create_gloo_process_groups=False)
            model_parallel_cuda_manual_seed(0)
            tcfg = bridge.transformer_config(hf_config, parallel, params_dtype=dtype, use_te=False,
                                             use_cpu_initialization=True, perform_initialization=False,
                                             moe_token_dispatcher_type="alltoall")
            with torch.device("meta"):
                chunks = bridge.build_model(hf_config, tcfg, use_te=False,
                                            pg_collection=ProcessGroupCollection.use_mpu_process_groups())
            params = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
            numel = sum(p.numel() for _, p in params)
            expert = sum(p.numel() for name, p in params if not getattr(p, "allreduce", True))
            frozen = sum(p.numel() * p.element_size() for _, p in params)
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                       use_distributed_optimizer=distributed_optimizer)
            wrapped = [DistributedDataParallel(tcfg, ddp_config, chunk if dtype == torch.float32 else
                                               Float16Module(tcfg, chunk), disable_bucketing=i > 0)
                       for i, chunk in enumerate(chunks)]
            buffers = [b for w in wrapped for b in (*w.buffers, *w.expert_parallel_buffers)]
            param_bytes = sum(b.param_data.numel() * b.param_data.element_size() if b.param_data is not None
                              else sum(p.numel() * p.element_size() for p in b.params) for b in buffers)
            grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
            if distributed_optimizer:
                shard = sum(r["param"].size for b in buffers
                            for per_dtype in DistributedOptimizer._build_gbuf_range_map(b).values()
                            for bucket in per_dtype for r in bucket["param_map"].values())
            else:
                shard = sum(p.numel() for b in buffers for p in b.params)
            main = 4 * shard if dtype != torch.float32 else 0
            out.append(asdict(RankState(
                rank=int(rank), pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                dp_rank=parallel_state.get_data_parallel_rank(), ep_rank=parallel_state.get_expert_model_parallel_rank(),
                params=numel, expert_params=expert, param_bytes=param_bytes, grad_bytes=grad_bytes,
                main_param_bytes=main, optimizer_bytes=2 * 4 * shard, frozen_param_bytes=frozen)))
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return out


def hf_config_dict(hf_config: Any) -> dict[str, Any]:
    """A transformers config as the JSON the child rebuilds it from (``model_type`` kept)."""
    d = hf_config.to_dict()
    d["model_type"] = hf_config.model_type
    return d


def census_request(hf_config: Any, parallel: Any, *, world_size: int, ranks: list[int], dtype: str,
                   use_distributed_optimizer: bool = True, make_vocab_size_divisible_by: int = 128,
                   lm_head: bool = True) -> dict[str, Any]:
    """One census question: ``ranks`` of a world of ``world_size`` under ``parallel`` (a ``ParallelConfig``)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError("model.dtype", f"{dtype!r} is not supported: use one of {', '.join(DTYPE_BYTES)}")
    # Sequence parallelism splits activations, not parameters; without it the local spec builds every layout
    # (megatron-core refuses sequence-parallel experts without TransformerEngine's layers).
    sizes = {**asdict(parallel), "sequence_parallel": False}
    return {
        "hf_config": hf_config_dict(hf_config), "parallel": sizes, "world_size": world_size,
        "ranks": list(ranks), "dtype": dtype, "use_distributed_optimizer": use_distributed_optimizer,
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "lm_head": lm_head,
    }


_ANSWERS: dict[str, list[RankState]] = {}  # this process's answers so far, by request (a census is deterministic)


def run_census(requests: list[dict[str, Any]]) -> list[list[RankState]]:
    """The answers to :func:`census_request` questions, in order, counted in one child process (questions this
    process asked before are answered from memory)."""
    keys = [json.dumps(r, sort_keys=True) for r in requests]
    todo = [r for r, k in zip(requests, keys, strict=True) if k not in _ANSWERS]
    if todo:
        for request, rows in zip(todo, _run_child(todo), strict=True):
            _ANSWERS[json.dumps(request, sort_keys=True)] = rows
    return [_ANSWERS[k] for k in keys]


class _Child:
    """One census child kept for this process's later questions (its imports take seconds; a build, less)."""

    def __init__(self) -> None:
        import tempfile

        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "mcore_agentic.plan.census", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=env)
        atexit.register(self.close)  # one left running at exit

    def ask(self, requests: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(requests) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            raise RuntimeError(f"the model census failed:\n{self.stderr.read()[-3000:]}")
        answer = json.loads(line)
        if isinstance(answer, dict):  # the child's error for this question; the child lives on
            raise ConfigError(answer["field"], answer["message"]) if answer.get("field") else RuntimeError(
                f"the model census failed: {answer['message']}")
        return answer

    def close(self) -> None:
        """End the child (stdin closed: it finishes its loop), killed after 10 s."""
        atexit.unregister(self.close)
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


_CHILD: _Child | None = None


def shutdown_census() -> None:
    """End this process's census child, if one runs, and free its host memory (0.5-1 GB: torch, megatron-core and
    transformers imported). The answers it gave stay in memory; a later new question starts a new child."""
    global _CHILD
    child, _CHILD = _CHILD, None
    if child is not None:
        child.close()


def _run_child(requests: list[dict[str, Any]]) -> list[list[RankState]]:
    global _CHILD
    if _CHILD is None or _CHILD.proc.poll() is not None:
        _CHILD = _Child()
    return [[RankState(**row) for row in rows] for rows in _CHILD.ask(requests)]


def serve() -> None:
    """The child: one JSON list of questions per line in, one JSON list of answers per line out (or an error
    object), until stdin closes."""
    for line in sys.stdin:
        try:
            answer: Any = [_census_here(request) for request in json.loads(line)]
        except ConfigError as exc:
            answer = {"field": exc.field, "message": str(exc).removeprefix(f"{exc.field}: ")}
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which raises it
            answer = {"message": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


def main() -> None:
    if "--serve" in sys.argv[1:]:
        serve()
    else:
        print(json.dumps([_census_here(request) for request in json.loads(sys.stdin.read())]))


if __name__ == "__main__":
    main()
