"""The Megatron model's device policy without a GPU: micro-batches built on the host, copied to the compute device once,
and the head, the CP gather, the response layout and the PPO / value losses run there on device tensors only.

Two stand-ins for a GPU, each for what it can check on a CPU-only torch:

* torch's ``FakeTensorMode`` gives tensors a real ``cuda:0`` device: :func:`to_device` must put every tensor the
  forward and the loss read there. (Its CUDA tensors cannot be sliced or recorded by autograd without CUDA.)
* the ``meta`` device runs the whole last-stage computation: a host tensor meeting a device one raises, and so does
  a host read of a device value (``.tolist()``, ``.item()``, ``float()``) — the two ways the first GPU step would
  have crashed or stalled on a per-row sync. :class:`_NoHostToDevice` adds the third, which the first GPU run found
  (``torch.as_tensor(18, device=cuda)`` in the loss normaliser, under ``set_sync_debug_mode("error")``): host data
  becoming a device tensor after the one copy is a synchronous copy from pageable memory on every micro-batch.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from mcore_agentic.algorithms.config import PolicyLossConfig, ValueLossConfig
from mcore_agentic.algorithms.losses import loss_normalisers
from mcore_agentic.algorithms.objective import actor_objective, critic_objective
from mcore_agentic.algorithms.sequence_advantages import compute_grpo_outcome_advantage
from mcore_agentic.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy
from mcore_agentic.workers import micro_batch
from mcore_agentic.workers.micro_batch import (
    build_micro_batch,
    merge_outputs,
    post_process,
    rows_in_order,
    sum_metrics,
    to_device,
)
from mcore_agentic.workers.sequence import scatter_rows
from tests.helpers.torch_calls import target_device
from tests.unit.workers._fixtures import PROMPT, VOCAB, make_batch

CUDA = torch.device("cuda", 0)
META = torch.device("meta")


class _NoHostToDevice(TorchFunctionMode):
    """Refuses host data becoming a device tensor: ``torch.tensor`` / ``as_tensor`` / ``scalar_tensor`` given a
    device, and ``.to`` / ``.cuda`` / ``.copy_`` from a host tensor to a device one. Fills (``full``, ``new_full``,
    ``zeros``) are kernels and pass."""

    _MAKERS = (torch.tensor, torch.as_tensor, torch.scalar_tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._MAKERS:
            dev = kwargs.get("device")
            data = args[0] if args else kwargs.get("data")
            on_device = isinstance(data, torch.Tensor) and data.device.type != "cpu"
            if dev is not None and torch.device(dev).type != "cpu" and not on_device:
                raise AssertionError(f"host data copied to {dev} by {func.__name__}")
        elif func is torch.where:  # a host 0-dim operand is copied to the device, synchronously
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(t.device.type == "cpu" for t in tensors) and any(t.device.type != "cpu" for t in tensors):
                raise AssertionError("a host tensor mixed into torch.where on the device")
        elif func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_):
            src = args[1] if func is torch.Tensor.copy_ else args[0]
            dst = args[0].device if func is torch.Tensor.copy_ else target_device(args[1:], kwargs)
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst is not None and dst.type != "cpu":
                raise AssertionError(f"a host tensor {tuple(src.shape)} copied to {dst} by {func.__name__}")
        return func(*args, **kwargs)


def _host_rows(n: int = 4):
    batch = make_batch(n, seed=3)
    r = batch["responses"].shape[1]
    g = torch.Generator().manual_seed(0)
    return batch.update({
        "old_log_probs": -torch.rand(n, r, generator=g), "advantages": torch.randn(n, r, generator=g),
        "values": torch.randn(n, r, generator=g), "returns": torch.randn(n, r, generator=g),
    })


def _micro_batch(rows, pack: bool = True):
    """The host micro-batch of ``rows`` on one CP rank."""
    return build_micro_batch(rows, PROMPT, pack=pack, common=0, cp_size=1, cp_rank=0, multiple_of=1, replay=False)


def _actor_pass(dev, norms, device: torch.device):
    """Random logits on ``device`` through the head and the PPO loss of the moved micro-batch ``dev``:
    ``(loss, metrics, logits)``."""
    logits = torch.randn(*dev.tokens.shape, VOCAB, device=device, requires_grad=True)
    loss, _, metrics = post_process(dev, _head, _actor_loss(norms), False, logits, cp_size=1, cp_group=None)
    return loss, metrics, logits


def _head(logits: torch.Tensor, mb) -> dict[str, torch.Tensor]:
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, mb.labels, group=None, vocab_start_index=0, vocab_size=VOCAB)
    return {"log_probs": lp, "entropys": ent}


def _actor_loss(norms):
    def loss_fn(resp, mb):
        d = mb.data
        out = actor_objective(
            PolicyLossConfig(), norms, old_log_probs=d["old_log_probs"], log_probs=resp["log_probs"],
            entropys=resp["entropys"], advantages=d["advantages"], response_mask=d["response_mask"],
        )
        return out.loss, out.metrics

    return loss_fn


def _critic_loss(norms):
    def loss_fn(resp, mb):
        d = mb.data
        out = critic_objective(
            ValueLossConfig(), norms, vpreds=resp["values"], returns=d["returns"], values=d["values"],
            response_mask=d["response_mask"],
        )
        return out.loss, out.metrics

    return loss_fn


def _on(mb, device: torch.device) -> list[str]:
    """Names of the tensors of a moved micro-batch that are not on the device."""
    fields = {"tokens": mb.tokens, "labels": mb.labels, "position_ids": mb.position_ids}
    for name in ("tokens", "labels", "position_ids", "left_pad", "lengths", "starts", "cu_seqlens", "cu_seqlens_real"):
        fields[f"packed.{name}"] = getattr(mb.packed, name)
    if mb.packed_seq_params is not None:
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            fields[f"params.{name}"] = getattr(mb.packed_seq_params, name)
    fields.update({f"data.{k}": v for k, v in mb.data.tensors.items()})
    return [k for k, v in fields.items() if v is not None and v.device != device]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_a_micro_batch_goes_to_cuda_in_one_copy(pack: bool):
    rows = _host_rows()
    mb = _micro_batch(rows, pack)
    assert mb.tokens.device.type == "cpu" and (mb.cu_seqlens_host is not None) == pack
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = to_device(mb, CUDA)
        assert _on(dev, CUDA) == []
    assert dev.cu_seqlens_host == mb.cu_seqlens_host  # the host copy the CP gather reads stays
    if pack:  # no padding between rows (CP 1): one offsets object, so TE < 2.18 need not compare them per layer
        assert mb.packed_seq_params.cu_seqlens_q_padded is mb.packed_seq_params.cu_seqlens_q
        assert dev.packed_seq_params.cu_seqlens_q_padded is dev.packed_seq_params.cu_seqlens_q
    if pack:  # the local spec: PackedSeqParams' offsets stay host tensors (read as integers in every layer)
        with FakeTensorMode(allow_non_fake_inputs=True):
            local = to_device(mb, CUDA, offsets_on_device=False)
        assert [k for k in _on(local, CUDA) if not k.startswith("params.")] == []
        assert local.packed_seq_params.cu_seqlens_q.device.type == "cpu"
        # ... and the padded offsets once on the device, for the varlen attention kernel
        assert local.packed_seq_params.cu_seqlens_device.device == CUDA
        assert local.packed_seq_params.cu_seqlens_device.dtype == torch.int32


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_a_micro_batch_trains_on_the_device_without_host_syncs(pack: bool):
    rows = _host_rows()
    mb = _micro_batch(rows, pack)
    norms = loss_normalisers(rows["response_mask"])
    dev = to_device(mb, META)
    assert _on(dev, META) == []
    with _NoHostToDevice():
        loss, metrics, logits = _actor_pass(dev, norms, META)
        assert loss.device == META and all(v.device == META for v in metrics.values())
        loss.backward()
        assert logits.grad.device == META
        values = torch.randn(*dev.tokens.shape, 1, device=META)
        vloss, _, _ = post_process(
            dev, lambda out, m: {"values": out.squeeze(-1)}, _critic_loss(norms), False, values, cp_size=1,
            cp_group=None,
        )
    assert vloss.device == META


def test_the_host_to_device_guard_can_fail():
    with _NoHostToDevice(), pytest.raises(AssertionError, match="as_tensor"):
        torch.as_tensor(18, dtype=torch.float32, device=META)  # what the loss normaliser did before the GPU run
    with _NoHostToDevice(), pytest.raises(AssertionError, match="host tensor"):
        torch.ones(2).to(META)
    with _NoHostToDevice():
        torch.ones(2, device=META).new_full((), 18.0)


def test_a_broadcast_row_is_pinned_after_a_copy(monkeypatch):
    """``pin_memory`` refuses a tensor whose elements share memory (a position row expanded over the batch): the
    first GPU run's packed benchmark died on it. Pinning is CUDA-only, so the stand-in refuses exactly what the real
    one does (``torch._debug_has_internal_overlap`` is the check torch runs)."""
    pinned: list[torch.Tensor] = []

    def pin(t: torch.Tensor) -> torch.Tensor:
        if torch._debug_has_internal_overlap(t) == 1:  # MemOverlap::Yes
            raise RuntimeError("more than one element of the written-to tensor refers to a single memory location")
        pinned.append(t)
        return t

    monkeypatch.setattr(micro_batch, "_can_pin", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    with pytest.raises(RuntimeError, match="single memory location"):
        pin(torch.arange(4).expand(3, 4))  # the stand-in can fail
    for pack in (True, False):
        mb = _micro_batch(_host_rows(), pack)
        with FakeTensorMode(allow_non_fake_inputs=True):
            dev = to_device(mb, CUDA)
        assert _on(dev, CUDA) == [] and pinned


def test_a_forward_only_pass_returns_host_outputs_for_the_experience_path():
    rows = _host_rows(6)
    groups = [[0, 2, 4], [1, 3, 5]]
    mbs = [_micro_batch(rows.index(g)) for g in groups]
    outs = []
    for mb in mbs:
        dev = to_device(mb, META)
        logits = torch.randn(*dev.tokens.shape, VOCAB, device=META)
        outs.append(post_process(dev, _head, None, True, logits, cp_size=1, cp_group=None)[2])
    merged = merge_outputs(outs)  # in micro-batch order, on the device
    assert all(v.device == META and v.shape == rows["responses"].shape for v in merged.values())
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_cuda = [{k: torch.zeros(len(g), *v.shape[1:], device=CUDA) for k, v in merged.items()} for g in groups]
        with _NoHostToDevice():  # no row index made on the device (GPU review P7: a pageable copy per key)
            device_merged = merge_outputs(on_cuda)
            with pytest.raises(AssertionError, match="host data copied"):  # what the merge did before
                scatter_rows([piece["log_probs"] for piece in on_cuda], groups, len(rows))
        host = {k: v.cpu() for k, v in device_merged.items()}  # what MegatronModel.forward_only copies back
    assert all(v.device.type == "cpu" and v.shape == rows["responses"].shape for v in host.values())
    # ... and puts in row order on the host: row r of micro-batch k is the batch's row groups[k][r]
    ordered = rows_in_order(torch.arange(6.0).unsqueeze(1), groups, 6)
    assert ordered.squeeze(1).tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    # The experience path (advantages) then meets host rows only.
    scores = torch.randn(len(rows))
    token_rewards = rows["response_mask"].float() * scores[:, None]
    adv, _ = compute_grpo_outcome_advantage(token_rewards, rows["response_mask"], torch.tensor([0, 0, 1, 1, 2, 2]))
    assert adv.device.type == "cpu"


def test_metrics_are_read_to_the_host_once():
    with pytest.raises(RuntimeError, match="meta"):
        float(torch.ones((), device=META))  # the checks above can fail: a host read of a device value raises
    outs = [{"a": torch.tensor(1.0), "b": torch.tensor(2.0)}, {"a": torch.tensor(0.5)}]
    assert sum_metrics(outs) == {"a": 1.5, "b": 2.0}


def test_the_host_micro_batch_on_the_device_fails_without_the_copy():
    """The test above can fail: the pre-policy model handed host micro-batches to a CUDA model."""
    rows = _host_rows()
    mb = _micro_batch(rows)
    norms = loss_normalisers(rows["response_mask"])
    logits = torch.randn(*mb.tokens.shape, VOCAB, device=META)
    with pytest.raises(RuntimeError, match="meta|device"):
        post_process(mb, _head, _actor_loss(norms), False, logits, cp_size=1, cp_group=None)


def test_the_distillation_terms_make_no_host_scalar_on_the_device():
    """GPU review m6: ``torch.where`` with a host 0-dim zero copies it to the device synchronously."""
    from mcore_agentic.algorithms.distillation import distillation_advantages, reverse_kl_per_token

    with FakeTensorMode(allow_non_fake_inputs=True):
        student, teacher = torch.zeros(2, 5, device=CUDA), torch.zeros(2, 5, device=CUDA)
        mask = torch.ones(2, 5, dtype=torch.long, device=CUDA)
        with _NoHostToDevice():
            assert reverse_kl_per_token(student, teacher, mask).device == CUDA
            assert distillation_advantages(student, student, teacher, mask, mode="add", coef=0.5).device == CUDA
