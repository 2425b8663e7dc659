"""``ModelConfig``: which Hugging Face checkpoint to train and how to lay it out in Megatron.

The frozen dataclass for the ``model`` group of the run config. Light imports only
(dataclasses, typing): the bridge in :mod:`mcore_agentic.models.bridge` turns it,
together with the HF ``config.json``, into a Megatron ``TransformerConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_agentic.utils.errors import require

DType = Literal["float32", "bfloat16", "float16"]
TransformerImpl = Literal["auto", "local", "transformer_engine"]


@dataclass(frozen=True)
class ModelConfig:
    """The ``model`` config group."""

    model_path: str
    """Directory of a Hugging Face checkpoint: ``config.json`` plus ``*.safetensors`` (sharded index allowed)."""

    dtype: DType = "float32"
    """Parameter dtype of the Megatron model (``params_dtype``). Use ``float32`` on CPU."""

    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times the tensor-parallel size (Megatron convention);
    padding rows are zero and removed again on export."""

    transformer_impl: TransformerImpl = "auto"
    """Layer spec: ``local`` (megatron-core only, runs on CPU), ``transformer_engine`` (requires TE and a GPU),
    or ``auto`` (TE when it is importable and CUDA is available, else local)."""

    use_remove_padding: bool = True
    """Train and score on packed rows (THD: one sequence per micro-batch with ``cu_seqlens``, attention per row),
    so a micro-batch costs its real tokens; false runs padded ``[rows, longest]`` micro-batches (for debugging)."""

    logits_chunk_mb: int = 256
    """The logits are never made whole: each pass that reads them (log-probs, entropy, a teacher's top k, and their
    backward) makes them for as many tokens at a time as fit this many MiB of fp32 on each rank, and the backward
    pass makes each chunk again instead of keeping it. 0 makes them whole (megatron-core's output layer), as
    before."""

    def __post_init__(self) -> None:
        require(bool(self.model_path), "model.model_path", "is empty: set it to a Hugging Face checkpoint directory")
        require(
            isinstance(self.logits_chunk_mb, int) and not isinstance(self.logits_chunk_mb, bool)
            and self.logits_chunk_mb >= 0,
            "model.logits_chunk_mb",
            f"{self.logits_chunk_mb!r} must be an integer >= 0 (MiB of fp32 logits per chunk; 0: whole logits)",
        )
        require(
            self.dtype in ("float32", "bfloat16", "float16"),
            "model.dtype",
            f"{self.dtype!r} is not supported: use float32, bfloat16 or float16",
        )
        require(
            isinstance(self.make_vocab_size_divisible_by, int) and self.make_vocab_size_divisible_by >= 1,
            "model.make_vocab_size_divisible_by",
            f"{self.make_vocab_size_divisible_by!r} must be a positive integer (Megatron's default is 128)",
        )
        require(
            self.transformer_impl in ("auto", "local", "transformer_engine"),
            "model.transformer_impl",
            f"{self.transformer_impl!r} is not supported: use auto, local or transformer_engine",
        )


def uses_transformer_engine(transformer_impl: str, device: str, te_importable: bool) -> bool:
    """Whether ``model.transformer_impl`` builds the TransformerEngine layer spec on ``device`` (``cuda``/``cpu``).

    ``transformer_engine``: always (``transformer_impl.use_te_for`` refuses it where TE or the GPU is missing);
    ``local``: never; ``auto``: on CUDA when TransformerEngine imports. Pure, so config rules can ask it on CPU.
    """
    if transformer_impl == "local":
        return False
    if transformer_impl == "transformer_engine":
        return True
    return device == "cuda" and te_importable
