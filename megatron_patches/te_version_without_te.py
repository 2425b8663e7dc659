"""Patch ``te_version_without_te``: the optimizer config's TransformerEngine version check without TransformerEngine.

Target: the name ``is_te_min_version`` in ``megatron.core.optimizer.optimizer_config``. ``OptimizerConfig`` with
``use_precision_aware_optimizer`` (which the CPU-offloaded optimizer requires, ``optimizer_cpu_offload``) asks
``is_te_min_version("2.1.0")`` to decide ``store_param_remainders``; without TransformerEngine installed
``get_te_version()`` is ``None`` and the comparison raises ``TypeError`` before any optimizer exists. The patch
answers False when TransformerEngine is absent (no version of it is installed, so no minimum is met), which turns
``store_param_remainders`` off exactly as an old TE would; with TE installed it is megatron's own check.

Reason: an import-guarded version compared unguarded. No numerical change. Applied on GPU too (not ``cpu_only``: a GPU
machine without TE has the same crash).

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when ``is_te_min_version`` handles a missing TE.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_patches._base import Patch, PatchContext

MODULE = "megatron.core.optimizer.optimizer_config"


def _guarded(is_te_min_version: Any) -> Any:
    @functools.wraps(is_te_min_version)
    def guarded(version: str, check_equality: bool = True) -> bool:
        from megatron.core.utils import get_te_version

        if get_te_version() is None:
            return False
        return is_te_min_version(version, check_equality)

    return guarded


def _install(ctx: PatchContext) -> None:
    ctx.swap_in(MODULE, "is_te_min_version", _guarded)


PATCH = Patch(
    name="te_version_without_te",
    reason="OptimizerConfig's precision-aware path compares TransformerEngine's version when TE is not installed",
    install=_install,
    cpu_only=False,
)
