"""Patch ``checkpoint_without_output_fp8``: selective recomputation of norms and MLPs works without TransformerEngine.

Target: ``megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__``. It sets ``self.fp8 = fp8 is not
None`` with ``fp8=False`` as the default, so every instance made without an argument (the transformer layer's
``recompute_modules`` ``layernorm`` and ``mlp``) believes FP8 is on, and its forward calls
``FP8GlobalStateManager``, a name that exists only when ``transformer_engine`` imports: without TE (the local spec,
on CPU and on a GPU machine without TE) the first such forward raises ``NameError``. With TE the call merely asks
whether FP8 is enabled, so the flag's inversion costs nothing there. The patch keeps the constructor and sets the
flag to what the argument means: FP8 only when one is given (``None`` and ``False`` are off).

Reason: an inverted default and an import-guarded name used unguarded. No numerical change. Applied on GPU too (not
``cpu_only``).

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove when megatron-core's default is ``None`` or its
test is ``bool(fp8)``.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_patches._base import Patch, PatchContext


def _fixed(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, fp8: Any = False) -> None:
        init(self, fp8)
        self.fp8 = fp8 is not None and fp8 is not False

    return __init__


def _install(ctx: PatchContext) -> None:
    cls = ctx.attr("megatron.core.tensor_parallel.random", "CheckpointWithoutOutput")
    if cls is not None:
        ctx.wrap(cls, "__init__", _fixed)


PATCH = Patch(
    name="checkpoint_without_output_fp8",
    reason="CheckpointWithoutOutput() believes FP8 is on and calls TransformerEngine's FP8 state without TE",
    install=_install,
    cpu_only=False,
)
