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

plus, once per micro-batch on the last stage, the final norm ``2h``, the output layer's input ``h`` and the
logits in fp32 (``V / TP`` per token): the log-softmax keeps them. The gradient of the logits (fp32, the same
size) exists at the start of the backward pass, so an update's peak is the saved bytes plus one logits-sized
buffer; a forward-only pass (old, reference, teacher log-probs, values) keeps nothing for backward and peaks at
the logits and their log-softmax (two logits-sized buffers) plus one layer's working set.
"""

from __future__ import annotations

from dataclasses import dataclass

LOGITS_BYTES = 4  # the log-softmax runs in fp32


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


def layer_elements_per_token(dims: Dims, split: Split, *, moe: bool) -> float:
    """Saved elements per token of one transformer layer on one rank (the linear terms of the module docstring)."""
    tp, size = split.tp, split.dtype_bytes
    h = dims.hidden / (tp if split.sequence_parallel else 1)  # SP: norms and linear inputs hold s/TP tokens
    q = dims.heads * dims.head_dim / tp
    kv = max(dims.kv_heads // tp, 1) * dims.head_dim  # fewer KV heads than TP ranks: each rank keeps one
    heads = dims.heads / tp
    per = 4 * h + 2 * 4 / size + 4 * dims.head_dim  # two RMSNorms (input, output, fp32 rstd), RoPE cos/sin
    per += h + q  # the QKV projection's input, the output projection's input
    if split.fused_attention:
        per += (q + 2 * kv) + (q + kv) + q + heads * 4 / size
    else:
        per += (q + 2 * kv) + 2 * q  # the QKV projection, queries and the GQA-expanded values; probs: quadratic
    if dims.qk_norm:
        per += 2 * q + kv  # the query norm's input and output, the key norm's output
    if moe:
        fe = dims.expert_ffn / tp
        # the router's input and fp32 probabilities; per routed copy: the permuted input, fc1's output (2f_e),
        # the activation's two saved halves, fc2's input and the unpermute's copy (6f_e in all)
        per += h + 2 * dims.experts * 4 / size + dims.top_k * (dims.hidden + 6 * fe)
    else:
        per += h + 5 * dims.ffn / tp  # fc1 input, fc1 output + activation (4f), fc2 input (f)
    return per


def saved_bytes(dims: Dims, split: Split, row_lengths: list[int], *, layers: int, last_stage: bool) -> int:
    """Bytes autograd keeps for one micro-batch of rows ``row_lengths`` (packed) through ``layers`` layers of this
    rank (``last_stage``: with the final norm, output layer and logits)."""
    tokens = sum(row_lengths) / split.cp
    moe_layers = min(dims.moe_layers, layers)
    per_token = (layers - moe_layers) * layer_elements_per_token(dims, split, moe=False)
    per_token += moe_layers * layer_elements_per_token(dims, split, moe=True)
    total = tokens * per_token * split.dtype_bytes
    if not split.fused_attention:
        heads = dims.heads / split.tp
        square = sum((s / split.cp) * s for s in row_lengths)  # each rank's queries against the whole row
        total += layers * square * (heads * 4 + 1)
    if last_stage:
        total += tokens * 3 * dims.hidden * split.dtype_bytes
        total += tokens * dims.vocab / split.tp * LOGITS_BYTES
    return int(total)


def logits_bytes(dims: Dims, split: Split, tokens: int) -> int:
    """One fp32 logits buffer of ``tokens`` tokens on one rank."""
    return int(tokens / split.cp * dims.vocab / split.tp * LOGITS_BYTES)


def update_peak_bytes(dims: Dims, split: Split, row_lengths: list[int], *, layers: int, last_stage: bool,
                      in_flight: int = 1) -> int:
    """An update's activation peak on one rank: ``in_flight`` micro-batches' saved tensors (1F1B keeps up to
    PP - stage of them) plus the logits' gradient on the last stage."""
    saved = saved_bytes(dims, split, row_lengths, layers=layers, last_stage=last_stage)
    grad = logits_bytes(dims, split, sum(row_lengths)) if last_stage else 0
    return in_flight * saved + grad


def forward_peak_bytes(dims: Dims, split: Split, row_lengths: list[int], *, last_stage: bool) -> int:
    """A forward-only pass's peak on one rank: one layer's working set, and on the last stage the logits and
    their log-softmax."""
    one_layer = saved_bytes(dims, split, row_lengths, layers=1, last_stage=False)
    return one_layer + (2 * logits_bytes(dims, split, sum(row_lengths)) if last_stage else 0)
