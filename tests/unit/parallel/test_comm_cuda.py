"""On a GPU: the communication policy under the launcher's ``cpu:gloo,cuda:nccl`` group, and the engine's device
policy with real CUDA tensors — one copy to the device, and no host synchronisation in the head and the loss
(``torch.cuda.set_sync_debug_mode("error")`` raises on any). Skipped cleanly without CUDA; the GPU check
(``bench/gpu/check.sh``) runs ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _policy_on_cuda(rank: int, world_size: int) -> dict[str, str]:
    import torch.distributed as dist

    from mcore_agentic.parallel import comm

    out = {"backend": str(dist.get_backend()), "device": str(comm.compute_device())}
    payload = comm.as_device(torch.ones(4, device=comm.compute_device()))
    comm.all_reduce_device(payload)
    out["device_call"] = str(payload.device)
    host = comm.all_reduce_host(comm.to_host(payload))  # a device value read back once, reduced on gloo
    out["host_call"] = str(host.device)
    comm.barrier()
    out["object"] = str(comm.broadcast_object({"ok": 1}))
    for name, fn in {
        "host_call_with_cuda": lambda: comm.all_reduce_host(comm.device_zeros(2, dtype=torch.float32)),
        "device_call_with_cpu": lambda: comm.all_reduce_device(torch.zeros(2)),
    }.items():
        try:
            fn()
            out[name] = "ok"
        except comm.CommPolicyError:
            out[name] = "refused"
    return out


def test_host_and_device_calls_under_the_mixed_backend():
    (out,) = run_distributed(_policy_on_cuda, world_size=1, timeout=300)
    assert out["backend"] == "cpu:gloo,cuda:nccl"
    assert out["device"].startswith("cuda") and out["device_call"].startswith("cuda")
    assert out["host_call"] == "cpu" and out["object"] == "{'ok': 1}"
    assert out["host_call_with_cuda"] == "refused" and out["device_call_with_cpu"] == "refused"


def test_a_micro_batch_trains_on_cuda_without_host_syncs():
    from mcore_agentic.algorithms.losses import loss_normalisers
    from mcore_agentic.workers.micro_batch import to_device
    from tests.unit.workers.test_device_policy import _actor_pass, _host_rows, _micro_batch, _on

    cuda = torch.device("cuda", torch.cuda.current_device())
    rows = _host_rows()
    mb = _micro_batch(rows)
    norms = loss_normalisers(rows["response_mask"])
    dev = to_device(mb, cuda)
    assert _on(dev, cuda) == []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _, logits = _actor_pass(dev, norms, cuda)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.device == cuda and logits.grad is not None and torch.isfinite(loss).item()
