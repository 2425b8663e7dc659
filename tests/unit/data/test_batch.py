"""Batch: shared leading dim, immutable updates, split/concat/index round trips."""

import pytest
import torch

from mcore_agentic.data.batch import Batch


def _batch(n: int = 6) -> Batch:
    return Batch(
        tensors={"x": torch.arange(n * 3).view(n, 3), "m": torch.ones(n, 2)},
        meta={"uid": [f"u{i}" for i in range(n)]},
        info={"step": 1},
    )


def test_mismatched_sizes_rejected():
    with pytest.raises(ValueError, match="disagree"):
        Batch(tensors={"x": torch.zeros(3, 1)}, meta={"uid": ["a", "b"]})


def test_update_does_not_mutate():
    b = _batch()
    c = b.update(tensors={"y": torch.zeros(6)}, note="n")
    assert "y" in c and "y" not in b
    assert c.info == {"step": 1, "note": "n"}


def test_split_concat_roundtrip():
    b = _batch(7)
    parts = b.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["uid"] == b["uid"]


def test_chunk_requires_even_split():
    assert [len(p) for p in _batch(6).chunk(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="equal chunks"):
        _batch(7).chunk(2)


def test_index_and_shuffled_minibatches_cover_all_rows():
    b = _batch(6)
    g = torch.Generator().manual_seed(0)
    seen = sorted(u for mb in b.iter_minibatches(4, shuffle=True, generator=g) for u in mb["uid"])
    assert seen == sorted(b["uid"])
    sub = b.index([5, 0])
    assert sub["uid"] == ["u5", "u0"] and torch.equal(sub["x"][0], b["x"][5])


def test_missing_key_names_what_exists():
    with pytest.raises(KeyError, match="tensors="):
        _batch()["nope"]
