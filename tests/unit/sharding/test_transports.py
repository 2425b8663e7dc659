"""Single-process checks: the tensor transport into a real ``HFEngine``, the version check, ``LiveBytes``."""

from __future__ import annotations

import gc

import pytest
import torch

from mcore_agentic.rollout.engines.hf import HFEngine
from mcore_agentic.sharding.exporter import LiveBytes
from mcore_agentic.sharding.manager import NoEngine
from mcore_agentic.sharding.transports import StaleWeightsError, TensorTransport, WeightVersion, make_transport
from mcore_agentic.utils.errors import ConfigError
from tests.unit.sharding._fixtures import hf_config, make_batch, random_model, teacher_forced_log_probs


def _buckets(state: dict[str, torch.Tensor], size: int) -> list[list[tuple[str, torch.Tensor]]]:
    items = list(state.items())
    return [items[i : i + size] for i in range(0, len(items), size)]


@pytest.mark.parametrize("tied", [False, True])
def test_tensor_transport_makes_engine_equal_source(tied):
    source = random_model(hf_config(tied=tied), seed=0)
    engine = HFEngine(random_model(hf_config(tied=tied), seed=1))
    batch = make_batch(4)
    want = teacher_forced_log_probs(source, batch)
    assert (teacher_forced_log_probs(engine.model, batch) - want).abs().max() > 0.1
    state = {k: v for k, v in source.state_dict().items() if not (tied and k == "lm_head.weight")}
    stats = make_transport("tensor").send(_buckets(state, 5), engine, version=3)
    assert engine.weight_version == 3
    assert stats.buckets == -(-len(state) // 5) and stats.tensors == len(state)
    assert stats.bytes == sum(t.numel() * 4 for t in state.values())
    assert torch.equal(teacher_forced_log_probs(engine.model, batch), want)
    WeightVersion(3).check(engine)


def test_sync_to_no_engine_drains_every_bucket_and_advances_its_version():
    """A rank without an engine still pulls every bucket (the export's collectives run as buckets are pulled)."""
    state = random_model(hf_config(), seed=0).state_dict()
    pulled = []

    def buckets():
        for bucket in _buckets(state, 4):
            pulled.append(len(bucket))
            yield bucket

    engine = NoEngine()
    stats = TensorTransport().send(buckets(), engine, version=5)
    assert sum(pulled) == len(state) == stats.tensors and stats.buckets == len(pulled)
    WeightVersion(5).check(engine)


def test_incomplete_sync_is_refused_and_keeps_the_version():
    source = random_model(hf_config(), seed=0)
    engine = HFEngine(random_model(hf_config(), seed=1))
    state = dict(list(source.state_dict().items())[:-1])
    with pytest.raises(ValueError, match="left 1 tensors unset"):
        TensorTransport().send(_buckets(state, 4), engine, version=1)
    assert engine.weight_version == 0


def test_stale_engine_is_a_clear_error():
    engine = HFEngine(random_model(hf_config(), seed=1))
    version = WeightVersion()
    version.check(engine)
    version.bump()
    with pytest.raises(StaleWeightsError) as err:
        version.check(engine)
    assert (err.value.engine_version, err.value.trainer_version) == (0, 1)
    assert "weight version 0" in str(err.value) and "at version 1" in str(err.value)


def test_unknown_transport_names_the_field():
    with pytest.raises(ConfigError, match=r"^sharding\.transport"):
        make_transport("disk")


def test_live_bytes_counts_storages_once_until_the_last_view_dies():
    tracker = LiveBytes()
    a = tracker.track(torch.empty(100, dtype=torch.float32))
    views = [tracker.track(v) for v in a.chunk(4)]
    assert tracker.live == 400
    b = tracker.track(torch.empty(50, dtype=torch.float64))
    assert tracker.live == tracker.peak == 800
    del a
    gc.collect()
    assert tracker.live == 800  # the views keep the storage
    views.clear()
    assert tracker.live == 400
    del b
    assert tracker.live == 0 and tracker.peak == 800
