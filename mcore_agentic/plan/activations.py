"""Activation bytes of one micro-batch: what autograd keeps for the backward pass, and a forward-only pass's peak.

The per-token counts follow what megatron-core's local layer spec and this product's attention save (listed
below, checked against the tensors autograd really saves on CPU by ``tests/unit/plan/test_activations.py``):

per transformer layer, per token, in elements of the model dtype (``h`` hidden, ``q`` = heads x head_dim,
``kv`` = KV heads x head_dim, ``f`` the MLP's intermediate size, ``d`` head_dim; TP divides ``q``, ``kv``, ``f``
and the heads, sequence parallelism divides the ``h`` terms too)

- the two RMSNorms: their input and output, ``4h`` (plus one fp32 ``rstd`` each)
- the linear layers' inputs: QKV and fc1 ``2h``, the output projection ``q``, fc2 ``f``
- SwiGLU: the fc1 output ``2f``, the gate's activation and the product, ``4f`` in all with fc1's
- rotary embeddings: ``cos``/``sin`` for queries and keys, ``4d``
- fused attention (flash/SDPA, the GPU path): the QKV projection ``q + 2kv``, rotated queries and keys
  ``q + kv``, the output ``q``, the log-sum-exp (fp32, one per head)
- eager attention (the local spec off GPU) instead keeps each row's ``heads x s x s`` probabilities (fp32) and a
  boolean mask of ``s x s``: quadratic in the row length
- query/key RMSNorm (Qwen3): the query norm's input and output ``2q``, the key norm's output ``kv``
- a mixture-of-experts layer replaces the MLP's ``h + 5f`` by the router's input ``h`` and fp32 probabilities
  over the experts, and per routed copy (``top_k`` per token) the permuted input ``h`` and ``6f_e`` (fc1's
  output, the activation's saved halves, fc2's input and output)

plus, once per micro-batch on the last stage, the final norm ``2h``, the output layer's input ``h`` and, with
``model.logits_chunk_mb=0``, the logits in fp32 (``V / TP`` per token): the log-softmax keeps them. The gradient of
the logits (fp32, the same size) exists at the start of the backward pass, so an update's peak is the saved bytes
plus one logits-sized buffer; a forward-only pass (old, reference, teacher log-probs, values) keeps nothing for
backward and peaks at the logits and their log-softmax (two logits-sized buffers) plus one layer's working set.
With chunked logits (the default) none are kept, and every logits-sized buffer is one chunk's
(:attr:`Split.logits_chunk_tokens` tokens).

With activation recomputation (``actor.recompute_*``, megatron-core's), measured the same way:

- ``full``: a recomputed unit of layers keeps only its input, ``h`` per token, and the micro-batch keeps the rotary
  frequencies once (the longest row x ``d``, fp32); ``uniform`` recomputes every unit of ``recompute_num_layers``
  layers of each model chunk, ``block`` the first ``recompute_num_layers`` layers of each chunk one by one (the
  others keep everything). During the backward pass one unit's activations exist again at a time.
- ``selective``: ``core_attn`` drops the attention kernel's own output and log-sum-exp, ``q + heads`` (fp32), and
  eager attention's quadratic probabilities; ``layernorm`` the two norms, ``4h`` and their ``rstd``; ``mlp`` a dense
  MLP's ``5f``; ``moe`` a mixture-of-experts layer's router probabilities and routed copies.

Every micro-batch also keeps its log-prob head's and loss's per-token tensors (indices, log-probs, masks, the
entropy): :data:`HEAD_BYTES_PER_TOKEN`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOGITS_BYTES = 4  # the log-softmax runs in fp32
HEAD_BYTES_PER_TOKEN = 90
"""The log-prob head's and the loss's saved tensors per token (int64 indices, fp32 log-probs, ratios and entropy,
boolean masks; measured, in the response layout's slots)."""
ROTARY_BYTES = 4  # rotary frequencies are fp32


@dataclass(frozen=True)
class Dims:
    """The shapes activations depend on (from the HF config, as the bridge maps it)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int  # the padded vocabulary (the output layer's rows)
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    moe_layers: int = 0
    qk_norm: bool = False  # Qwen3: RMSNorm on each query and key head


@dataclass(frozen=True)
class Split:
    """How one rank sees a micro-batch: the parallel sizes that divide its activations."""

    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    fused_attention: bool = True
    dtype_bytes: int = 2
    logits_chunk_tokens: int = 0
    """Tokens whose logits exist at once (``model.logits_chunk_mb``; 0: the whole micro-batch's, kept for the
    backward pass)."""


@dataclass(frozen=True)
class Recompute:
    """A trained model's activation recomputation, as megatron-core applies it (``RecomputeConfig.megatron_kwargs``)."""

    granularity: str | None = None
    """``full``, ``selective`` or None (off)."""
    method: str = "uniform"
    num_layers: int = 1
    modules: tuple[str, ...] = ()

    @classmethod
    def of(cls, recompute: Any) -> Recompute:
        """From a role's ``RecomputeConfig`` (``actor.recompute``); None: off."""
        kw = recompute.megatron_kwargs() if recompute is not None else {}
        return cls(granularity=kw.get("recompute_granularity"), method=str(kw.get("recompute_method") or "uniform"),
                   num_layers=int(kw.get("recompute_num_layers") or 1), modules=tuple(kw.get("recompute_modules") or ()))

    def selects(self, module: str) -> bool:
        return self.granularity == "selective" and module in self.modules


def layer_elements_per_token(dims: Dims, split: Split, *, moe: bool, recompute: Recompute = Recompute()) -> float:
    """Saved elements per token of one transformer layer on one rank (the linear terms of the module docstring);
    ``recompute``'s selective modules drop theirs (``full`` is :func:`saved_bytes`'s)."""
    tp, size = split.tp, split.dtype_bytes
    h = dims.hidden / (tp if split.sequence_parallel else 1)  # SP: norms and linear inputs hold s/TP tokens
    q = dims.heads * dims.head_dim / tp
    kv = max(dims.kv_heads // tp, 1) * dims.head_dim  # fewer KV heads than TP ranks: each rank keeps one
    heads = dims.heads / tp
    per = 4 * dims.head_dim  # RoPE cos/sin
    if not recompute.selects("layernorm"):
        per += 4 * h + 2 * 4 / size  # two RMSNorms (input, output, fp32 rstd)
    per += h + q  # the QKV projection's input, the output projection's input
    if recompute.selects("core_attn"):  # the kernel runs again in the backward pass: only its inputs stay
        per += (q + 2 * kv) + (q + kv)
    elif split.fused_attention:
        per += (q + 2 * kv) + (q + kv) + q + heads * 4 / size
    else:
        per += (q + 2 * kv) + 2 * q  # the QKV projection, queries and the GQA-expanded values; probs: quadratic
    if dims.qk_norm:
        per += 2 * q + kv  # the query norm's input and output, the key norm's output
    if moe:
        fe = dims.expert_ffn / tp
        # the router's input and fp32 probabilities; per routed copy: the permuted input, fc1's output (2f_e),
        # the activation's two saved halves, fc2's input and the unpermute's copy (6f_e in all)
        per += h
        if not recompute.selects("moe"):
            per += 2 * dims.experts * 4 / size + dims.top_k * (dims.hidden + 6 * fe)
    else:
        per += h + (0 if recompute.selects("mlp") else 5 * dims.ffn / tp)  # fc1 input, fc1 output + act (4f), fc2 input
    return per


def _quadratic_bytes(dims: Dims, split: Split, row_lengths: list[int]) -> float:
    """Eager attention's probabilities (fp32) and boolean mask of one layer: each rank's queries against the row."""
    heads = dims.heads / split.tp
    return sum((s / split.cp) * s for s in row_lengths) * (heads * 4 + 1)


def saved_bytes(dims: Dims, split: Split, row_lengths: list[int], *, layers: int, last_stage: bool,
                recompute: Recompute = Recompute(), chunks: int = 1) -> int:
    """Bytes autograd keeps for one micro-batch of rows ``row_lengths`` (packed) through ``layers`` layers of this
    rank, in ``chunks`` model chunks (VPP) (``last_stage``: with the final norm, output layer and logits), at the
    end of its forward pass."""
    tokens = sum(row_lengths) / split.cp
    size = split.dtype_bytes
    per_chunk = layers / chunks
    if recompute.granularity == "full":
        n = max(recompute.num_layers, 1)
        if recompute.method == "block":
            recomputed = chunks * min(n, per_chunk)
            inputs = recomputed  # each recomputed layer keeps its own input
        else:
            recomputed, inputs = layers, chunks * -(-per_chunk // n)
    else:
        recomputed = inputs = 0
    kept = layers - recomputed
    moe_layers = min(dims.moe_layers, layers)
    moe_kept = kept * moe_layers / layers if layers else 0
    per_token = (kept - moe_kept) * layer_elements_per_token(dims, split, moe=False, recompute=recompute)
    per_token += moe_kept * layer_elements_per_token(dims, split, moe=True, recompute=recompute)
    per_token += inputs * dims.hidden / (split.tp if split.sequence_parallel else 1)
    total = tokens * per_token * size
    if recomputed:
        total += max(row_lengths, default=0) / split.cp * dims.head_dim * ROTARY_BYTES  # the checkpoints' rotary input
    if not split.fused_attention and not recompute.selects("core_attn"):
        total += kept * _quadratic_bytes(dims, split, row_lengths)
    if last_stage:
        if split.logits_chunk_tokens:
            # chunked logits are made again in the backward pass, not kept: the final norm's input stays, and the
            # model's output (its hidden states, cast to fp32) that each chunk's logits are made from
            total += tokens * dims.hidden * (size + 4)
        else:  # the final norm's input and output, the output layer's input, the logits
            total += tokens * 3 * dims.hidden * size
            total += tokens * dims.vocab / split.tp * LOGITS_BYTES
        total += tokens * HEAD_BYTES_PER_TOKEN
    return int(total)


def recompute_working_bytes(dims: Dims, split: Split, row_lengths: list[int], *, layers: int,
                            recompute: Recompute = Recompute(), chunks: int = 1) -> int:
    """What the backward pass rebuilds at once under ``recompute``: one unit's layers (``full``), one layer's
    recomputed modules (``selective``); 0 without recomputation."""
    if recompute.granularity == "full":
        n = 1 if recompute.method == "block" else min(max(recompute.num_layers, 1), max(layers // chunks, 1))
        unit = saved_bytes(dims, split, row_lengths, layers=n, last_stage=False)
        return unit
    if recompute.granularity == "selective":
        one = saved_bytes(dims, split, row_lengths, layers=1, last_stage=False)
        kept = saved_bytes(dims, split, row_lengths, layers=1, last_stage=False, recompute=recompute)
        return max(one - kept, 0)
    return 0


def logits_bytes(dims: Dims, split: Split, tokens: int) -> int:
    """One fp32 logits buffer of ``tokens`` tokens on one rank (of one chunk of them with chunked logits)."""
    local = tokens / split.cp
    if split.logits_chunk_tokens:
        local = min(local, split.logits_chunk_tokens)
    return int(local * dims.vocab / split.tp * LOGITS_BYTES)


def update_peak_bytes(dims: Dims, split: Split, row_lengths: list[int], *, layers: int, last_stage: bool,
                      in_flight: int = 1, recompute: Recompute = Recompute(), chunks: int = 1) -> int:
    """An update's activation peak on one rank: ``in_flight`` micro-batches' saved tensors (1F1B keeps up to
    PP - stage of them), what recomputation rebuilds at once, and the logits' gradient on the last stage."""
    saved = saved_bytes(dims, split, row_lengths, layers=layers, last_stage=last_stage, recompute=recompute,
                        chunks=chunks)
    # the logits' gradient; chunked, one chunk's logits made again, its softmax and its gradient at a time
    grad = (3 if split.logits_chunk_tokens else 1) * logits_bytes(dims, split, sum(row_lengths)) if last_stage else 0
    rebuilt = recompute_working_bytes(dims, split, row_lengths, layers=layers, recompute=recompute, chunks=chunks)
    return in_flight * saved + rebuilt + grad


def forward_peak_bytes(dims: Dims, split: Split, row_lengths: list[int], *, last_stage: bool) -> int:
    """A forward-only pass's peak on one rank: one layer's working set, and on the last stage the logits and
    their log-softmax."""
    one_layer = saved_bytes(dims, split, row_lengths, layers=1, last_stage=False)
    return one_layer + (2 * logits_bytes(dims, split, sum(row_lengths)) if last_stage else 0)
