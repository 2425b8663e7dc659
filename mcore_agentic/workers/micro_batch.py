"""Micro-batches and the Megatron model's device policy: built on the host, copied to the compute device once, outputs
back to the host once per pass.

* :func:`build_micro_batch` cuts a replica's host rows into what Megatron's forward takes (packed THD with
  ``PackedSeqParams`` or padded, CP-split, the routing of routing replay) — all on the host, where the per-row
  Python loops and ``.tolist()`` calls cost nothing; the host copy of ``cu_seqlens`` that the CP gather needs
  rides along (:attr:`MicroBatch.cu_seqlens_host`).
* :func:`to_device` copies a micro-batch, the fields the loss reads included (``data``: old log-probs,
  advantages, returns...), to the compute device in one go: from pinned memory and non-blocking on CUDA.
* :func:`post_process` runs on the last pipeline stage on device tensors only: head, CP gather, response layout,
  loss. No host sync on a device tensor happens there.
* :func:`merge_outputs` concatenates a forward-only pass's per-micro-batch outputs on the device; the model
  returns them to the host once per pass and :func:`rows_in_order` puts them back in row order there (with host
  indices: no index is copied to the device), so the experience path (advantages, returns, metrics) works on host
  tensors only.

``tests/unit/workers/test_device_policy.py`` runs this path on fake CUDA tensors (torch's ``FakeTensorMode``):
a CPU tensor meeting a CUDA one, or a host read of a device value, fails there without a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_agentic.data.batch import TOKEN_FIELDS, Batch
from mcore_agentic.parallel.cp_split import cp_gather, cp_packed_indices, cp_positions, cp_split
from mcore_agentic.workers.routing_replay import model_layout_routing
from mcore_agentic.workers.sequence import PackedSequences, pack_rows, pad_rows, scatter_rows

# head_fn(model_output [b, S/cp, ...], micro_batch) -> per-token tensors [b, S/cp] of the local CP shard.
HeadFn = Callable[[torch.Tensor, "MicroBatch"], dict[str, torch.Tensor]]
# loss_fn(per-response-token tensors [b, R], micro_batch) -> (loss share, metric shares summed over micro-batches).
LossFn = Callable[[dict[str, torch.Tensor], "MicroBatch"], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class MicroBatching:
    """How a rank's rows are cut into micro-batches."""

    micro_batch_size: int
    """Rows per micro-batch when ``use_dynamic_bsz`` is false."""
    use_dynamic_bsz: bool = False
    """Cut by a token budget instead."""
    max_token_len: int = 16384
    """The budget with ``use_dynamic_bsz``: packed tokens per micro-batch (padded: rows x padded length)."""
    field: str = "actor.ppo_max_token_len_per_gpu"
    """Config key named when a single sequence exceeds the budget."""
    pack: bool = True
    """Packed (THD) micro-batches (``model.use_remove_padding``); False: padded ``[b, S]`` ones."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the model and the callbacks see it."""

    data: Batch
    """This micro-batch's rows of the batch (all keys: advantages, old_log_probs, ...)."""
    packed: PackedSequences
    """Rows with left padding removed, full (un-split) length: ``[b, S]`` padded or ``[1, T]`` packed."""
    tokens: torch.Tensor
    """This CP rank's tokens (load-balanced layout): ``[b, S/cp]`` or ``[1, T/cp]``."""
    labels: torch.Tensor
    """Next-token targets of ``tokens``."""
    position_ids: torch.Tensor
    """Positions of ``tokens`` within their rows."""
    packed_seq_params: Any = None
    """Megatron's ``PackedSeqParams`` (THD) of a packed micro-batch; None when padded."""
    routing: torch.Tensor | None = None
    """The rollout engine's routed experts of ``tokens`` in the routers' order ``[s, b, moe_layers, top_k]`` (routing
    replay, when the rows carry ``routed_experts``); None otherwise."""
    cu_seqlens_host: tuple[int, ...] | None = None
    """The padded ``cu_seqlens`` as host integers (packed only): the CP gather's index lists are built from
    these, never from a device tensor."""
    candidates: torch.Tensor | None = None
    """Next-token ids to score at each of ``tokens``, laid out like ``labels`` with a trailing ``[k]``: a
    distillation teacher's top ``k`` (the rows' ``teacher_top_k_ids``; 0 off the response); None otherwise."""


def build_micro_batch(
    data: Batch, prompt_len: int, *, pack: bool, common: int, cp_size: int, cp_rank: int, multiple_of: int,
    replay: bool,
) -> MicroBatch:
    """This CP rank's micro-batch of the host rows ``data`` (``common``: a length every micro-batch of the step is
    padded to, 0 for none; ``replay``: lay out the rows' ``routed_experts`` for the routers)."""
    layout = dict(cp_size=cp_size, multiple_of=multiple_of)
    replay = replay and "routed_experts" in data
    if not pack:
        packed = pad_rows(data["input_ids"], data["attention_mask"], prompt_len, min_len=common, **layout)
        pos = cp_positions(packed.padded_len, cp_size, cp_rank, device=packed.tokens.device)
        candidates = _candidates(packed, data)
        return MicroBatch(
            data=data, packed=packed, tokens=cp_split(packed.tokens, cp_size, cp_rank),
            labels=cp_split(packed.labels, cp_size, cp_rank), position_ids=pos.unsqueeze(0).expand(len(data), -1),
            routing=model_layout_routing(packed, data["routed_experts"], cp_size, cp_rank) if replay else None,
            candidates=cp_split(candidates, cp_size, cp_rank) if candidates is not None else None,
        )
    from megatron.core.packed_seq_params import PackedSeqParams

    packed = pack_rows(data["input_ids"], data["attention_mask"], prompt_len, min_total=common, **layout)
    local = cp_packed_indices(packed.cu_seqlens, cp_size, cp_rank, device=packed.tokens.device)
    # Nothing padded: the padded offsets are the same tensor object as the real ones, which TransformerEngine
    # (< 2.18) takes as "no padding between rows" without comparing them on the device in every layer.
    padded = packed.cu_seqlens_real if torch.equal(packed.cu_seqlens, packed.cu_seqlens_real) else packed.cu_seqlens
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens_real,
        cu_seqlens_kv=packed.cu_seqlens_real,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )
    candidates = _candidates(packed, data)
    return MicroBatch(
        data=data, packed=packed, tokens=packed.tokens[:, local], labels=packed.labels[:, local],
        position_ids=packed.position_ids[:, local], packed_seq_params=params,
        routing=model_layout_routing(packed, data["routed_experts"], cp_size, cp_rank) if replay else None,
        cu_seqlens_host=tuple(packed.cu_seqlens.tolist()),
        candidates=candidates[:, local] if candidates is not None else None,
    )


def _candidates(packed: PackedSequences, data: Batch) -> torch.Tensor | None:
    """The rows' ``teacher_top_k_ids`` ``[b, R, k]`` moved to the positions that predict each response token
    (the one before it, where ``labels`` holds it), in ``packed``'s layout ``[*tokens.shape, k]``; None without."""
    if "teacher_top_k_ids" not in data:
        return None
    ids = data["teacher_top_k_ids"]
    b, r, k = ids.shape
    p = packed.prompt_len
    aligned = ids.new_zeros((b, p + r, k))  # column c holds the candidates for token c + 1
    aligned[:, p - 1 : p + r - 1] = ids
    return packed.gather_tokens(aligned)


def _can_pin() -> bool:
    """Whether host memory can be page-locked here (a CUDA runtime is present)."""
    return torch.cuda.is_available()


def _copy(t: Any, device: torch.device) -> Any:
    """``t`` on ``device``: from pinned memory and non-blocking when it goes from the host to a real GPU."""
    if not isinstance(t, torch.Tensor) or t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda" and _can_pin():
        # pin_memory refuses views whose elements share memory (an expanded position row): copy those first.
        t = (t if t.is_contiguous() else t.contiguous()).pin_memory()
    return t.to(device, non_blocking=True)


def to_device(mb: MicroBatch, device: torch.device, *, offsets_on_device: bool = True) -> MicroBatch:
    """``mb`` with every tensor the forward, the head and the loss read on ``device`` (the host copies of
    ``cu_seqlens`` and the scalar lengths stay). Identity when it is already there.

    ``offsets_on_device``: the ``PackedSeqParams`` offsets go to the device (TransformerEngine's attention and
    fused RoPE read them there) or stay on the host (the local spec and megatron's unfused THD RoPE read them as
    Python integers in every layer: host tensors cost no sync; ``models.transformer_impl.thd_offsets_on_host``)."""
    if mb.tokens.device == device:
        return mb

    def move(t: Any) -> Any:
        return _copy(t, device)

    packed = dataclasses.replace(
        mb.packed, tokens=move(mb.packed.tokens), labels=move(mb.packed.labels),
        position_ids=move(mb.packed.position_ids), left_pad=move(mb.packed.left_pad),
        lengths=move(mb.packed.lengths), starts=move(mb.packed.starts), cu_seqlens=move(mb.packed.cu_seqlens),
        cu_seqlens_real=move(mb.packed.cu_seqlens_real),
    )
    params = mb.packed_seq_params
    if params is not None and offsets_on_device:
        same = params.cu_seqlens_q_padded is params.cu_seqlens_q  # keep "nothing padded" an identity
        padded = packed.cu_seqlens_real if same else packed.cu_seqlens
        params = dataclasses.replace(
            params, cu_seqlens_q=packed.cu_seqlens_real, cu_seqlens_kv=packed.cu_seqlens_real,
            cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
        )
    elif params is not None:  # host offsets, and the padded ones once on the device for the varlen kernel
        from megatron.core.packed_seq_params import PackedSeqParams

        from mcore_agentic.parallel.local_attention import LocalPackedSeqParams

        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(PackedSeqParams)}
        params = LocalPackedSeqParams(**fields, cu_seqlens_device=packed.cu_seqlens)
    # The loss's fields (old log-probs, advantages, masks...); routed experts already live in ``routing``.
    data = Batch(
        tensors={k: move(v) for k, v in mb.data.tensors.items() if k not in TOKEN_FIELDS},
        meta=mb.data.meta, info=mb.data.info,
    )
    return dataclasses.replace(
        mb, data=data, packed=packed, tokens=move(mb.tokens), labels=move(mb.labels),
        position_ids=move(mb.position_ids), packed_seq_params=params, routing=move(mb.routing),
        candidates=move(mb.candidates),
    )


def post_process(
    mb: MicroBatch, head_fn: HeadFn, loss_fn: LossFn | None, forward_only: bool, output: torch.Tensor, *,
    cp_size: int, cp_group: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's last-stage loss function: head -> CP gather -> response layout -> loss (device tensors only)."""
    per_token = head_fn(output, mb)
    cu = list(mb.cu_seqlens_host) if mb.cu_seqlens_host is not None else None
    response = {
        k: mb.packed.to_response(cp_gather(v, cp_size, cp_group, seq_dim=1, grad_mode="slice", cu_seqlens=cu))
        for k, v in per_token.items()
    }
    one = torch.ones((), dtype=torch.int, device=output.device)
    if forward_only or loss_fn is None:
        zero = torch.zeros((), dtype=torch.float32, device=output.device)
        return zero, one, {k: v.detach() for k, v in response.items()}
    loss, metrics = loss_fn(response, mb)
    return loss, one, {k: v.detach().reshape(()) for k, v in metrics.items()}


def merge_outputs(outputs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A forward-only pass's per-micro-batch ``[b, R, ...]`` outputs, concatenated in micro-batch order on their
    device (:func:`rows_in_order` puts them back in row order once they are on the host: an index made on the device
    would be a synchronous copy from pageable memory per micro-batch and key): floating outputs as float32, integer
    ones (a teacher's top-k ids) as int64."""
    keys = sorted(outputs[0])
    merged = {k: torch.cat([o[k] for o in outputs]) for k in keys}
    return {k: v.float() if v.is_floating_point() else v.long() for k, v in merged.items()}


def rows_in_order(merged: torch.Tensor, groups: Sequence[Sequence[int]], num_rows: int) -> torch.Tensor:
    """:func:`merge_outputs`' rows (micro-batch order, on the host) in the batch's row order."""
    pieces = list(merged.split([len(g) for g in groups]))
    return scatter_rows(pieces, groups, num_rows)


def sum_metrics(outputs: Sequence[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Per-micro-batch metric shares summed, read to the host in one copy (not one sync per value)."""
    keys = sorted({k for out in outputs for k in out})
    if not keys:
        return {}
    ref = next(iter(outputs[0].values()))
    table = torch.stack([
        torch.stack([out[k].double() if k in out else torch.zeros((), dtype=torch.float64, device=ref.device) for k in keys])
        for out in outputs
    ])
    return dict(zip(keys, table.sum(0).tolist()))


__all__ = [
    "HeadFn", "LossFn", "MicroBatch", "MicroBatching", "build_micro_batch", "merge_outputs", "post_process",
    "rows_in_order",
    "sum_metrics", "to_device",
]
