"""Explicit, named patches to megatron-core: CPU/gloo stand-ins, checkpoint-load fixes and one save speed-up.

Nothing is patched on import: call :func:`apply` once (``launch/`` and tests do).
Each patch module names its target symbol, the reason, the supported
megatron-core versions and when it can go. Two kinds:

* CPU/gloo patches (``cpu_only``): megatron-core hard-codes CUDA on these paths. When
  CUDA is available they are not applied (the real CUDA paths work) unless ``force=True``.
* checkpoint-load fixes (``dist_checkpointing_weights_only`` and the ``distopt_load_*``
  patches): bugs of megatron-core 0.16.1 / torch's checkpoint planner that do not depend
  on the device, applied whether or not CUDA is available.
  ``mcore_agentic.trainer.model_checkpoint.load_worker`` refuses to load without them.
  ``moe_router_gemm_without_te`` is device-independent too (an MoE router without
  TransformerEngine), and so is ``checkpoint_without_output_fp8`` (selective recomputation of norms and
  MLPs without TransformerEngine): :data:`DEVICE_INDEPENDENT_PATCH_NAMES` lists every patch applied on GPU.
  So is ``save_results_in_process``: a synchronous save's write results stay in the saving process instead of
  going through a spawned ``multiprocessing.Manager`` (3 s on each rank's first save).

Public API::

    megatron_patches.apply()                       # all patches, idempotent
    megatron_patches.apply(["rng_tracker"])        # a subset, by name
    megatron_patches.revert()                      # undo (tests)
    megatron_patches.applied() -> tuple[str, ...]
    megatron_patches.PATCH_NAMES
    megatron_patches.CHECKPOINT_PATCH_NAMES

Patches rebind names inside megatron-core modules (mostly their module-global
``torch``, see ``_cpu_torch``, or a method of a megatron-core class) — never the real
``torch`` module, except setup-time contexts that restore on exit (``_cpu_torch.tensor_methods``):
``Tensor.type`` names in the optimizer constructors, ``Tensor.cuda`` as identity in a few
setup/checkpoint functions, and the hybrid optimizer's host copies while it splits its parameters
(``is_cuda``) or moves a loaded state (``to("cuda")``), on CPU only.

The context-parallel attention layer is not a patch (nothing is replaced): it is
``mcore_agentic.parallel.local_attention.LocalDotProductAttention``, chosen by a layer spec.
This package imports megatron-core and torch only.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable

from megatron_patches._base import Patch, PatchContext

logger = logging.getLogger("megatron_patches")

# Application order matters only for readability; patches touch disjoint symbols.
PATCH_NAMES: tuple[str, ...] = (
    "rng_tracker",
    "tensor_parallel_devices",
    "transformer_devices",
    "pipeline_p2p",
    "ddp_buffers",
    "optimizer_devices",
    "hybrid_optimizer_devices",
    "te_version_without_te",
    "hybrid_optimizer_state_dict",
    "rerun_state_machine",
    "parallel_state_sync",
    "dist_checkpointing_devices",
    "rope_cp_slice",
    "tied_embedding_sync",
    "moe_devices",
    "moe_dispatch_splits",
    "moe_router_gemm_without_te",
    "checkpoint_without_output_fp8",
    "dist_checkpointing_weights_only",
    "distopt_load_unstepped",
    "distopt_load_step_key",
    "distopt_load_shared_step",
    "save_results_in_process",
)

_ACTIVE: dict[str, PatchContext] = {}

TESTED_MEGATRON_CORE = ("0.16.1",)
"""megatron-core versions every patch (and its probe test) was verified on; setup.py pins this range."""


class MissingPatchTargets(RuntimeError):
    """This megatron-core version lacks symbols the patches replace: they would do half their work."""


def get_patch(name: str) -> Patch:
    """The :class:`Patch` object called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in PATCH_NAMES:
        raise ValueError(f"unknown megatron patch {name!r}: known patches are {', '.join(PATCH_NAMES)}")
    return importlib.import_module(f"megatron_patches.{name}").PATCH


DEVICE_INDEPENDENT_PATCH_NAMES: tuple[str, ...] = tuple(n for n in PATCH_NAMES if not get_patch(n).cpu_only)
"""The patches that are not ``cpu_only``: applied on GPU too."""

CHECKPOINT_PATCH_NAMES: tuple[str, ...] = tuple(
    n for n in DEVICE_INDEPENDENT_PATCH_NAMES if n.startswith(("dist_checkpointing_", "distopt_load_"))
)
"""The patches that are not ``cpu_only`` (the checkpoint-load fixes): applied on GPU too."""


def apply(names: Iterable[str] | None = None, *, force: bool = False) -> tuple[str, ...]:
    """Apply the named patches (default: all). Idempotent; returns the names now active.

    When CUDA is available the ``cpu_only`` patches are skipped (the checkpoint-load fixes
    still apply); ``force=True`` applies them anyway (for tests only).
    """
    import torch

    skip_cpu_only = torch.cuda.is_available() and not force
    missing: list[str] = []
    for name in PATCH_NAMES if names is None else tuple(names):
        if name in _ACTIVE:
            continue
        patch = get_patch(name)
        if patch.cpu_only and skip_cpu_only:
            logger.debug("megatron patch %s skipped: CUDA available, CPU patch not needed", name)
            continue
        ctx = PatchContext(name)
        patch.install(ctx)
        if ctx.missing:
            ctx.restore()
            missing.append(f"{name}: {', '.join(ctx.missing)}")
            continue
        _ACTIVE[name] = ctx
        logger.debug("megatron patch %s applied (%d swaps): %s", name, len(ctx.swaps), patch.reason)
    if missing:
        from importlib.metadata import version

        raise MissingPatchTargets(
            f"megatron-core {version('megatron-core')} lacks what these patches replace ({'; '.join(missing)}); "
            f"they are tested on megatron-core {', '.join(TESTED_MEGATRON_CORE)}: install that version"
        )
    return applied()


def revert(names: Iterable[str] | None = None) -> None:
    """Undo the named patches (default: all active ones), newest first."""
    targets = list(_ACTIVE) if names is None else [n for n in names if n in _ACTIVE]
    for name in reversed(targets):
        _ACTIVE.pop(name).restore()


def applied() -> tuple[str, ...]:
    """Names of the patches currently in effect, in application order."""
    return tuple(_ACTIVE)


__all__ = [
    "CHECKPOINT_PATCH_NAMES",
    "DEVICE_INDEPENDENT_PATCH_NAMES",
    "PATCH_NAMES",
    "TESTED_MEGATRON_CORE",
    "MissingPatchTargets",
    "Patch",
    "applied",
    "apply",
    "get_patch",
    "revert",
]
