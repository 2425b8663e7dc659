"""Offload -> reload of parameters, gradients and optimizer state is bit-identical (plain torch)."""

import copy

import pytest
import torch

from mcore_agentic.workers.offload import Offloader, model_grad_tensors, model_param_tensors, optimizer_tensors


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=g)
    opt.zero_grad(set_to_none=False)
    model(x).pow(2).mean().backward()
    opt.step()


def test_offload_frees_storage_and_reload_is_bit_identical():
    model, opt = _model_and_opt()
    _step(model, opt, 1)
    twin_model, twin_opt = _model_and_opt()  # same seeds and steps, never offloaded
    _step(twin_model, twin_opt, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = copy.deepcopy(opt.state_dict())

    off = Offloader()
    moved = off.offload("params", model_param_tensors([model]))
    moved += off.offload("grads", model_grad_tensors([model]))
    moved += off.offload("optimizer", optimizer_tensors(opt))
    assert moved > 0
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for s in opt.state.values() for v in s.values() if v.dim() > 0)
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload("params", [])

    for group in ("optimizer", "grads", "params"):
        off.reload(group)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    after = opt.state_dict()
    for pid, st in state_before["state"].items():
        for name, t in st.items():
            assert torch.equal(after["state"][pid][name], t), (pid, name)

    # The next update is unchanged by the round trip.
    _step(model, opt, 2)
    _step(twin_model, twin_opt, 2)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)


def test_reload_unknown_group_errors():
    with pytest.raises(RuntimeError, match="not offloaded"):
        Offloader().reload("params")


def test_optimizer_only_offload_keeps_aliased_params():
    # Megatron's fp32 distributed optimizer holds views of the parameters as its "main params":
    # offloading only the optimizer must not free the model's weights.
    model, opt = _model_and_opt()
    _step(model, opt, 1)
    views = [p.data.view(-1)[:3] for p in model.parameters()]  # stand-ins for the aliasing shards
    off = Offloader()
    off.offload("optimizer", optimizer_tensors(opt) + views, exclude=model_param_tensors([model]))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for s in opt.state.values() for v in s.values() if v.dim() > 0)
    off.reload("optimizer")
