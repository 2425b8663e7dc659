"""Patch ``parallel_state_sync``: ``parallel_state`` without ``torch.cuda.synchronize``.

Target: ``megatron.core.parallel_state`` (module-global ``torch`` rebound to the
CPU view): ``initialize_model_parallel`` with SHARP and ``update_pg_timeout``
call ``torch.cuda.synchronize()`` and pass ``device_ids=[torch.cuda.current_device()]``.

Reason: on CPU there is nothing to synchronise; these calls raise without CUDA.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when these paths check the backend.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, ("megatron.core.parallel_state",))


PATCH = Patch(
    name="parallel_state_sync",
    reason="parallel_state calls torch.cuda.synchronize() on some init/timeout paths",
    install=_install,
)
