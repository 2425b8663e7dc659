"""The parallel layout of a run: process-group setup and teardown, and the device a run uses.

:func:`initialize_parallel` creates Megatron's process groups once and returns a
:class:`ParallelLayout` — the object other packages receive (house rule: pass the layout
down, don't reach into ``parallel_state``). The sizes' divisibility rules (world size,
heads, layers, rollout groups) live in one place, :mod:`mcore_agentic.config.rules`, and are
checked before any process group exists; :func:`check_cpu_support` refuses what needs CUDA.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def check_cpu_support(
    cfg: ParallelConfig,
    *,
    field_prefix: str = "actor",
    apply_rope_fusion: bool = False,
    cuda_available: bool | None = None,
) -> None:
    """Refuse features that need TransformerEngine (sequence parallelism, fused RoPE) when there is no CUDA."""
    p = field_prefix
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available and cfg.sequence_parallel:
        raise ConfigError(
            f"{p}.sequence_parallel",
            "needs TransformerEngine on CUDA and is not supported on CPU: set it to false",
        )
    if not cuda_available and apply_rope_fusion:
        raise ConfigError(
            f"{p}.apply_rope_fusion",
            "fused RoPE needs TransformerEngine on CUDA and is not supported on CPU: set it to false",
        )


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel dimension (TP, PP, VPP, CP, DP, and EP for mixture-of-experts models) and this rank's
    coordinate in each.

    Process groups are fetched on demand (they are live objects, not state), from
    Megatron's ``parallel_state`` which :func:`initialize_parallel` set up.
    """

    world_size: int
    rank: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    data_parallel_size: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    expert_model_parallel_size: int
    """EP (mixture-of-experts models): ranks sharing one MoE layer's experts, carved out of the DP x CP ranks of
    one TP rank; 1 for a dense model."""
    ep_rank: int
    """This rank's index in its expert-parallel group: it holds experts ``ep_rank * E / EP`` onwards."""
    backend: str

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_model_parallel_size - 1

    def tp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    def pp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_group()

    def cp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def dp_group(self, with_context_parallel: bool = False) -> dist.ProcessGroup:
        """Data-parallel group; ``with_context_parallel=True`` is the DP x CP group gradients reduce over."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel)

    def ep_group(self) -> dist.ProcessGroup:
        """The expert-parallel group (tokens reach their experts by all-to-all over it; an expert's owner
        broadcasts it over it on export)."""
        from megatron.core import parallel_state

        return parallel_state.get_expert_model_parallel_group()

    def expert_dp_group(self) -> dist.ProcessGroup:
        """The expert-data-parallel group: the ranks holding the same experts (their gradients reduce over it)."""
        from megatron.core import parallel_state

        return parallel_state.get_expert_data_parallel_group()

    def process_groups(self) -> Any:
        """Megatron's ``ProcessGroupCollection`` of this layout: every group a model is built with
        (TP, PP, CP, DP, EP and their products), handed to ``GPTModel`` so a model never fetches its own."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection.use_mpu_process_groups()

    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's DP replica (its TP x CP x PP peers, same ``dp_rank``); None when it is one rank."""
        return _REPLICAS.group if _REPLICAS is not None else None

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of DP replica ``dp_rank``, ascending (the first one receives the replica's rows)."""
        if _REPLICAS is None:
            raise RuntimeError("replica groups are made by initialize_parallel()")
        return list(_REPLICAS.ranks[dp_rank])

    def describe(self) -> str:
        """One line for logs: ``rank 0/2: TP 2 (rank 0) PP 1 (rank 0) CP 1 (rank 0) DP 1 (rank 0), gloo``
        (with ``VPP n`` under virtual pipeline stages and ``EP n (rank r)`` under expert parallelism)."""
        vpp = f" VPP {self.virtual_pipeline_model_parallel_size}" if self.virtual_pipeline_model_parallel_size else ""
        ep = f" EP {self.expert_model_parallel_size} (rank {self.ep_rank})" if self.expert_model_parallel_size > 1 else ""
        return (
            f"rank {self.rank}/{self.world_size}: TP {self.tensor_model_parallel_size} (rank {self.tp_rank}) "
            f"PP {self.pipeline_model_parallel_size} (rank {self.pp_rank}){vpp} "
            f"CP {self.context_parallel_size} (rank {self.cp_rank}) "
            f"DP {self.data_parallel_size} (rank {self.dp_rank}){ep}, {self.backend}"
        )


def select_device(requested: str) -> str:
    """Honour ``trainer.device`` before anything touches CUDA; returns ``"cuda"`` or ``"cpu"``.

    ``auto``: CUDA when torch sees a GPU. ``cuda`` without one is a :class:`ConfigError`.
    ``cpu`` on a machine with GPUs hides them (``CUDA_VISIBLE_DEVICES=""``) so that every
    later ``torch.cuda.is_available()`` (backend, model init, engine) says CPU; if CUDA was
    already initialised in this process that cannot work, and it is an error too.
    """
    if requested == "cpu":
        if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and torch.cuda.is_initialized():
            raise ConfigError(
                "trainer.device",
                "cpu was asked for but CUDA is already initialised in this process: "
                "launch with CUDA_VISIBLE_DEVICES= (empty) instead",
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "cpu"
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ConfigError(
            "trainer.device",
            f"cuda was asked for but torch sees no GPU ({build}); use trainer.device=cpu or auto, or run on a GPU node",
        )
    if requested not in ("auto", "cuda"):
        raise ConfigError("trainer.device", f"{requested!r} is not supported: use auto, cpu or cuda")
    return "cuda" if available else "cpu"


def local_world_size(world_size: int) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE``, else the whole world on one node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def default_backend() -> str:
    """``cpu:gloo,cuda:nccl`` when CUDA is available (see :mod:`.comm`), else ``gloo``."""
    return comm.backend_for("cuda" if torch.cuda.is_available() else "cpu")


DEFAULT_TIMEOUT_MINUTES = 60
_TIMEOUT_MINUTES = DEFAULT_TIMEOUT_MINUTES  # every group this process makes waits this long (init_distributed)


def init_distributed(timeout_minutes: int | None = None) -> None:
    """Initialise ``torch.distributed`` from the torchrun environment (``env://``) if not done yet.

    Without ``WORLD_SIZE`` in the environment (plain ``python``), runs as a world of one
    on a free loopback port. On CUDA, binds this process to GPU ``LOCAL_RANK`` and uses the mixed
    ``cpu:gloo,cuda:nccl`` backend. ``timeout_minutes`` (``trainer.dist_timeout_minutes``; None: as set before,
    else 60) bounds every wait of the groups made from then on: a host call that waits longer (ranks idle while
    one rank's rollout runs on) raises.
    With ``MCORE_AGENTIC_STRICT_COMM=1`` the communication policy's strict mode is on (:mod:`.comm`).
    """
    comm.enable_strict_from_env()
    global _TIMEOUT_MINUTES
    if timeout_minutes is not None:
        _TIMEOUT_MINUTES = timeout_minutes
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = default_backend()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(minutes=_TIMEOUT_MINUTES))


def new_groups(ranks_per_group: Sequence[Sequence[int]], rank: int) -> dist.ProcessGroup | None:
    """One process group per entry (every rank creates every group, in order: ``new_group`` is collective over
    the world), with the world's timeout; the one holding ``rank`` is returned (None if none does)."""
    mine = None
    for members in ranks_per_group:
        group = dist.new_group(list(members), timeout=timedelta(minutes=_TIMEOUT_MINUTES))
        if rank in members:
            mine = group
    return mine


@dataclass(frozen=True)
class _Replicas:
    ranks: tuple[tuple[int, ...], ...]  # per DP rank: its ranks
    group: dist.ProcessGroup | None  # this rank's replica (None when replicas are single ranks)


_REPLICAS: _Replicas | None = None


def _make_replica_groups(layout: ParallelLayout) -> _Replicas:
    """One process group per DP replica (all ranks call ``new_group`` for every replica, in order)."""
    world = layout.world_size
    if world == 1:
        return _Replicas(((0,),), None)
    dp_of = comm.host_zeros(world, dtype=torch.long)
    dp_of[layout.rank] = layout.dp_rank
    comm.all_reduce_host(dp_of)  # every rank's DP index (each rank wrote only its own slot)
    ranks = tuple(tuple(r for r in range(world) if int(dp_of[r]) == d) for d in range(layout.data_parallel_size))
    return _Replicas(ranks, new_groups(ranks, layout.rank) if len(ranks[0]) > 1 else None)


def megatron_sizes(cfg: ParallelConfig) -> dict[str, Any]:
    """``cfg``'s sizes as ``parallel_state.initialize_model_parallel``'s keyword arguments (the trainer's groups and
    the planner's census are made from the same)."""
    return dict(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
    )


def initialize_parallel(cfg: ParallelConfig, seed: int) -> ParallelLayout:
    """Create Megatron's TP/PP/CP/DP (and EP) process groups and seed its RNG tracker; return the layout.

    ``torch.distributed`` is initialised from the environment if needed. Seeding follows
    Megatron-LM: Python/torch RNGs get ``seed + 100 * pp_rank`` (stages differ), and
    ``model_parallel_cuda_manual_seed(seed)`` gives the tracker its TP-rank-specific streams
    and seeds the device generator with ``seed`` (on CPU that is the CPU generator).
    On CPU, call ``megatron_patches.apply()`` first (the tracker is CUDA-only otherwise).
    Check the sizes first (:func:`mcore_agentic.config.rules.check_world_size`).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_distributed()
    comm.enable_strict_from_env()
    if not torch.cuda.is_available():
        # The launcher (or a test) applies the CPU patches; this package never imports them.
        patches = sys.modules.get("megatron_patches")
        if patches is None or "rng_tracker" not in patches.applied():
            raise RuntimeError("on CPU call megatron_patches.apply() before initialize_parallel()")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised: call destroy_parallel() first")
    parallel_state.initialize_model_parallel(
        **megatron_sizes(cfg),
        distributed_timeout_minutes=_TIMEOUT_MINUTES,  # Megatron's own default is 30, whatever the world's is
    )
    layout = current_parallel_layout()
    global _REPLICAS
    _REPLICAS = _make_replica_groups(layout)
    stage_seed = seed + 100 * layout.pp_rank
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(seed)
    logger.info("parallel layout: %s", layout.describe())
    return layout


def current_parallel_layout() -> ParallelLayout:
    """The :class:`ParallelLayout` of the Megatron process groups that already exist in this process."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: call initialize_parallel() first")
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        backend=dist.get_backend(),
    )


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Tear down Megatron's parallel state (and, if asked, the default process group)."""
    import sys

    global _REPLICAS
    if _REPLICAS is not None and _REPLICAS.group is not None and dist.is_initialized():
        dist.destroy_process_group(_REPLICAS.group)
    _REPLICAS = None
    if "megatron.core.parallel_state" in sys.modules:  # never imported: nothing to destroy (and stay quick)
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
