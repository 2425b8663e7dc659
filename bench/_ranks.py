"""What every 2-rank benchmark does first: re-launch itself under torchrun, then set up gloo ranks on CPU."""

from __future__ import annotations

import os
import sys


def require_device(device: str) -> None:
    """Exit with a message when ``--device cuda`` is asked for and torch sees no GPU (before any re-launch)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")


def relaunched(script: str, argv: list[str] | None, nproc: int = 2) -> bool:
    """Outside torchrun: run ``script`` under torchrun with ``nproc`` ranks and return True (the caller returns)."""
    if "WORLD_SIZE" in os.environ:
        return False
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", "--nproc_per_node", str(nproc), script, *(argv if argv is not None else sys.argv[1:])])
    return True


def init_cpu_ranks() -> None:
    """One thread per rank, the megatron-core CPU patches, torch.distributed from torchrun's environment."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import megatron_patches
    from mcore_agentic.parallel.layout import init_distributed

    megatron_patches.apply()
    init_distributed()
