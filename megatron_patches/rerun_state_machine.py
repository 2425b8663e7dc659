"""Patch ``rerun_state_machine``: Megatron's result-validation state machine on CPU.

Target: ``megatron.core.rerun_state_machine`` (module-global ``torch`` rebound
to the CPU view): ``RerunStateMachine`` all-reduces flags in
``torch.tensor(..., device='cuda')``, records ``torch.cuda.current_device()`` and
saves/restores ``torch.cuda.get_rng_state()``. The pipeline schedules call
``validate_result`` on every loss, so it is on our path.

Reason: CUDA hard-coded. With the default mode (``disabled``) it only runs the
flag reductions; on CPU those are CPU tensors and the "CUDA" RNG is the CPU one.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when it takes a device.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, ("megatron.core.rerun_state_machine",))


PATCH = Patch(
    name="rerun_state_machine",
    reason="rerun state machine reduces flags in device='cuda' tensors",
    install=_install,
)
