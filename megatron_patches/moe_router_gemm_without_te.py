"""Patch ``moe_router_gemm_without_te``: the MoE router's gating GEMM works without TransformerEngine.

Target: ``megatron.core.transformer.moe.moe_utils.te_general_gemm``. ``RouterGatingLinearFunction`` tests
``te_general_gemm is not None`` on every forward and backward, but the name is only defined when
``transformer_engine`` imports: without TE every MoE forward raises ``NameError`` (on CPU and on a GPU
machine without TE alike). The patch defines it as ``None`` when it is absent, so the function takes its
plain ``torch`` matmul branch; with TE installed it does nothing.

Reason: an import-guarded name used unguarded. No numerical change. Applied on GPU too (not ``cpu_only``).

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when megatron-core sets the name in its
``except ImportError`` branch.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext


def _install(ctx: PatchContext) -> None:
    utils = ctx.module("megatron.core.transformer.moe.moe_utils")
    if utils is not None and not getattr(utils, "HAVE_TE", False) and not hasattr(utils, "te_general_gemm"):
        ctx.add(utils, "te_general_gemm", None)


PATCH = Patch(
    name="moe_router_gemm_without_te",
    reason="moe_utils.te_general_gemm is undefined without TransformerEngine but read on every router pass",
    install=_install,
    cpu_only=False,
)
