"""Separate placement's plumbing on a real job of 4 gloo ranks split 2 + 2: each side's world, the links, and what
crosses them (weights bucket by bucket, bitwise in every dtype; two engines' rows, statistics and metrics, merged on
the trainer's rank 0 with their group ids renumbered, and the metrics on every trainer rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mcore_agentic.data.batch import Batch, build_rollout_layout
from mcore_agentic.parallel.job import JobSplit
from tests.helpers.distributed import run_distributed

FIELDS = ("response_mask", "rollout_log_probs", "seq_scores", "group_index", "truncated", "weight_version")
PAD = 0


def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("odd.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: the next tensor starts unaligned
        ("w.f32", torch.randn(4, 7, generator=g)),
        ("ids.i64", torch.arange(6, dtype=torch.long).reshape(2, 3)),
        ("flag.bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5)),
    ]


def _rows(engine: int) -> Batch:
    prompts = [[5 + engine, 6], [7]] if engine == 0 else [[9, 9, 9]]
    responses = [[11, 12, 13], [14]] if engine == 0 else [[15, 16]]
    b = len(prompts)
    tensors = build_rollout_layout(
        prompts, responses, pad_token_id=PAD,
        response_fields={"response_mask": ([[1] * len(r) for r in responses], torch.long),
                         "rollout_log_probs": ([[-0.25 * (engine + 1)] * len(r) for r in responses], torch.float32)},
    )
    tensors.update(seq_scores=torch.arange(b, dtype=torch.float32) + engine, truncated=torch.zeros(b, dtype=torch.long),
                   group_index=torch.arange(b, dtype=torch.long), weight_version=torch.full((b,), 3 - engine))
    return Batch(tensors=tensors)


def _job(rank: int, world_size: int) -> dict[str, Any]:
    from mcore_agentic.feed import wire
    from mcore_agentic.feed.streamed import LinkEngine, Remote, StreamedRounds
    from mcore_agentic.parallel import comm
    from mcore_agentic.parallel.job import init_job
    from mcore_agentic.parallel.stats import Stats

    split = JobSplit(world_size, rollout_ranks=2, rollout_tp=1, rank=rank)
    links = init_job(split, timeout_minutes=2)
    side = comm.all_reduce_host(comm.to_host([1], torch.long))  # each side's own world
    out: dict[str, Any] = {"side_world": dist.get_world_size(), "side_sum": int(side[0])}
    if split.is_rollout:
        k = split.engine_index
        head = wire.recv_header(links, 0, up=False)
        out["bucket"] = wire.recv_bucket(links, head)
        out["weights"] = wire.recv_header(links, 0, up=False)[:2]
        want = wire.recv_header(links, 0, up=False)
        stats = Stats().add("score", [float(k), 2.0 * k + 1]).add("turns", [1.0])
        wire.send_reply(links, wire.ROWS, want[1], rows=_rows(k), fields=FIELDS, stats=stats,
                        metrics={"rollout/streamed_groups": 2.0 - k, "rollout/oldest_token_age": float(k),
                                 "rollout/partial_buffered_groups": 1.0})
        out["stop"] = wire.recv_header(links, 0, up=False)[0]
        return out
    remote = Remote(links, split.engines) if rank == 0 else None
    if remote is not None:
        engine = LinkEngine(remote)
        engine.update_weights(_bucket(), version=4)
        engine.finish_weight_update(4)
        engine.update_weights(_bucket(), version=4)  # the same version again (a validation's sync): not resent
        engine.finish_weight_update(4)
        remote.sender.drain()  # sent on the link's thread
        out["sent_bytes"] = remote.sent_bytes
    rounds = StreamedRounds(remote, pad_id=PAD, fields=FIELDS, routing_shape=None,
                            empty_stats=lambda: Stats().add("score", []).add("turns", []), version=lambda: 4)
    rounds.begin([], 7, lambda: [])
    out["counts"] = rounds.round(7)
    rollout = rounds.take(3, 0, 1)
    out["metrics"] = rollout.metrics
    out["stats"] = rollout.stats.reduce(world=True)
    if rollout.rows is not None:
        out["rows"] = {k: rollout.rows[k] for k in ("prompts", "responses", "attention_mask", *FIELDS)}
    rounds.close()
    return out


def test_a_split_job_has_two_worlds_and_links_that_carry_weights_rows_and_metrics() -> None:
    trainer0, trainer1, engine0, engine1 = run_distributed(_job, world_size=4, initialise=False)
    assert [r["side_world"] for r in (trainer0, trainer1, engine0, engine1)] == [2, 2, 1, 1]
    assert [r["side_sum"] for r in (trainer0, trainer1, engine0, engine1)] == [2, 2, 1, 1]
    sent = _bucket()
    for engine in (engine0, engine1):
        got = engine["bucket"]
        assert [n for n, _ in got] == [n for n, _ in sent]
        for (_, a), (_, b) in zip(got, sent):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert engine["weights"] == [2, 4]  # WEIGHTS, version 4: after every bucket
        assert engine["stop"] == 5
    assert trainer0["sent_bytes"] == 2 * sum(t.numel() * t.element_size() for _, t in sent)
    assert trainer0["counts"] == (3, 0, 0) and trainer1["counts"] == (0, 0, 0)
    rows = trainer0["rows"]
    assert rows["responses"].tolist() == [[11, 12, 13], [14, PAD, PAD], [15, 16, PAD]]
    assert rows["prompts"].tolist() == [[PAD, 5, 6], [PAD, PAD, 7], [9, 9, 9]]
    assert rows["group_index"].tolist() == [0, 1, 2]  # engine 1's group 0 follows engine 0's two rows
    assert rows["weight_version"].tolist() == [3, 3, 2]
    assert rows["rollout_log_probs"][2, :2].tolist() == [-0.5, -0.5]
    assert rows["response_mask"].sum().item() == 6
    # The engines' metrics, merged (ages: max; groups: sum), identical on every trainer rank, with the staleness
    # of what the step trains: version 4 against rows of versions 3 and 2.
    assert trainer0["metrics"] == trainer1["metrics"]
    m = trainer0["metrics"]
    assert m["rollout/oldest_token_age"] == 1.0 and m["rollout/partial_buffered_groups"] == 2.0
    assert m["rollout/staleness_max"] == 2.0 and m["rollout/staleness_mean"] == pytest.approx(4 / 3)
    assert (m["rollout/staleness_rows_0"], m["rollout/staleness_rows_1"], m["rollout/staleness_rows_2"]) == (0, 2, 1)
    # Statistics: both engines' values, reduced over the trainer's world.
    st = trainer1["stats"]
    assert st.total("score") == 0 + 1 + 1 + 3 and st.count("score") == 4 and st.max("score") == 3.0
    assert st.count("turns") == 2
