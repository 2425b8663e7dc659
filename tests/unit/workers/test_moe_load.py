"""Expert-load metrics from the routing maps of Megatron's routers (one process, no model: a stand-in hook call)."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.workers.moe_load import RouterLoad


class _Router:
    def __init__(self, layer: int):
        self.layer_number = layer


def _load(maps: dict[int, list[list[int]]]) -> RouterLoad:
    load = RouterLoad([])  # no model: feed the hook directly
    load.handles = [object()]  # enabled
    for layer, rows in maps.items():
        load._hook(_Router(layer), (), (None, torch.tensor(rows, dtype=torch.bool)))
    return load


def test_imbalance_per_layer_then_averaged():
    # Layer 1: 4 experts get 2, 1, 1, 0 tokens (mean 1, max 2); layer 2: 1, 1, 1, 1 (even).
    load = _load({1: [[1, 1, 0, 0], [1, 0, 1, 0]], 2: [[1, 1, 0, 0], [0, 0, 1, 1]]})
    m = load.pop()
    assert m["moe/load_imbalance"] == pytest.approx((2.0 + 1.0) / 2)
    assert m["moe/load_imbalance_max"] == pytest.approx(2.0)
    assert m["moe/idle_experts"] == 1.0
    assert load.pop() == {}  # reset


def test_counts_accumulate_over_passes_and_a_dense_model_reports_nothing():
    load = _load({1: [[1, 0], [1, 0]]})
    load._hook(_Router(1), (), (None, torch.tensor([[0, 1], [0, 1], [0, 1]], dtype=torch.bool)))
    assert load.pop()["moe/load_imbalance"] == pytest.approx(3 / 2.5)  # counts 2 and 3
    assert RouterLoad([]).pop() == {}
