"""The seam's table of fields (``feed/fields.py``) is the single source: a field added to it, and to nothing else,
is wanted by its setting, takes its value in filler rows, crosses the exchange between two gloo ranks in its dtype
and is part of the hand-off; a field the table lacks is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mcore_agentic.data.batch import TOKEN_FIELDS, Batch, build_rollout_layout
from mcore_agentic.feed import fields
from mcore_agentic.feed.fields import RowField, always_fields, select, wanted_fields
from tests.helpers.batches import hand_off_tensors
from tests.helpers.distributed import run_distributed

PAD = 7
NEW = (
    RowField("toy_row", torch.float32, "row", 0.5, "the test", doc="a per-row value every run sends"),
    RowField("toy_tokens", torch.long, "response", 0, "the test", setting="toy", wanted=lambda cfg: cfg.toy,
             doc="a per-response-token value a setting turns on"),
)


def _config(**on: bool) -> Any:
    """A config with every setting the table reads (all off unless ``on`` says so)."""
    return SimpleNamespace(
        algorithm=SimpleNamespace(turn_rewards=on.get("turn_rewards", False),
                                  adv_estimator="gigpo" if on.get("gigpo") else "grpo",
                                  rollout_correction=SimpleNamespace(enabled=on.get("correction", False))),
        rollout=SimpleNamespace(partial_rollout=SimpleNamespace(enable=on.get("partial", False)),
                                agent=SimpleNamespace(enabled=on.get("agent", False), train_samples="all")),
        actor=SimpleNamespace(moe=SimpleNamespace(routing_replay="R3" if on.get("replay") else "disable")),
        toy=on.get("toy", False),
    )


def test_each_setting_turns_on_its_fields_and_nothing_else():
    base = wanted_fields(_config())
    assert base == always_fields() == {"response_mask", "rollout_log_probs", "seq_scores", "group_index", "truncated",
                                       "weight_version"}
    assert wanted_fields(_config(turn_rewards=True)) - base == {"turn_rewards"}
    assert wanted_fields(_config(gigpo=True)) - base == {"turn_states"}
    assert wanted_fields(_config(partial=True)) == base  # token ages only for the rollout correction's metrics
    assert wanted_fields(_config(partial=True, correction=True)) - base == {"token_ages"}
    assert wanted_fields(_config(agent=True)) - base == {"episode_index", "turn_offset"}
    assert wanted_fields(_config(replay=True)) - base == {"routed_experts"}
    # The per-token fields are the batch's token fields (data/batch.py lays them out, aligned with input_ids).
    assert tuple(f.name for f in fields.FIELDS if f.per == "token") == TOKEN_FIELDS
    assert len({f.name for f in fields.FIELDS}) == len(fields.FIELDS)
    with pytest.raises(ValueError, match="no row field"):
        select(["not_a_field"])
    with pytest.raises(ValueError, match="travels as one of"):
        RowField("bad", torch.bool, "row", 0, "nobody")


@pytest.mark.parametrize("overrides,extra", [
    ([], set()),
    (["algorithm.adv_estimator=grpo_turn", "algorithm.turn_rewards=true"], {"turn_rewards"}),
    (["algorithm.adv_estimator=gigpo"], {"turn_states"}),
    (["rollout.partial_rollout.enable=true"], set()),
    (["rollout.partial_rollout.enable=true", "algorithm.rollout_correction.rollout_is=token"], {"token_ages"}),
    (["rollout.agent.entrypoint=examples/meter_agent.py:run", "rollout.multi_turn.tool_config_path=null"],
     {"episode_index", "turn_offset"}),
    (["actor.moe.routing_replay=rollout"], {"routed_experts"}),
])
def test_the_settings_of_a_real_config_want_their_fields(overrides, extra):
    from mcore_agentic.config import compose, load_config

    cfg = load_config(compose("default_tiny", overrides), log_aliases=False)
    assert wanted_fields(cfg) == always_fields() | extra


# ----------------------------------------------------------------------------------- two ranks
PROMPTS = [[[1, 2, 3], [4], [5, 6]], [[8, 9], [12]]]
RESPONSES = [[[20, 21], [22, 23, 24], []], [[27], [28, 29, 30, 31]]]


def _local(rank: int) -> Batch:
    """Rank ``rank``'s rollout group's rows, with the two toy fields (values that name their row and token)."""
    prompts, responses = PROMPTS[rank], RESPONSES[rank]
    b = len(prompts)
    toy_tokens = [[100 * rank + 10 * i + t for t in range(len(r))] for i, r in enumerate(responses)]
    tensors = build_rollout_layout(
        prompts, responses, pad_token_id=PAD,
        response_fields={"response_mask": ([[1] * len(r) for r in responses], torch.long),
                         "rollout_log_probs": ([[-0.5] * len(r) for r in responses], torch.float32),
                         "toy_tokens": (toy_tokens, torch.long)},
    )
    tensors.update(seq_scores=torch.arange(b, dtype=torch.float32) + rank, truncated=torch.zeros(b, dtype=torch.long),
                   toy_row=torch.arange(b, dtype=torch.float32) * 2 + 10 * rank + 1)
    return Batch(tensors=tensors, meta={"uid": [f"r{rank}u{i}" for i in range(b)], "oldest_version": [rank] * b,
                                        "request_metrics": [{}] * b})


def _exchange_new_fields(rank: int, world_size: int) -> dict[str, Any]:
    from mcore_agentic.feed import ReplicaRows
    from mcore_agentic.feed.distribute import exchange_rows, filler_rows, gather_shapes, plan_step, tag_groups

    fields.FIELDS = fields.FIELDS + NEW  # the table gets two fields; nothing else is told
    wanted = wanted_fields(_config(toy=True))
    assert {"toy_row", "toy_tokens"} <= wanted and "toy_row" in always_fields()
    local = _local(rank)
    if rank == 0:  # rank 0's group takes a filler row (as agent episodes' steps do)
        local = Batch.concat([local, filler_rows(local, 1, PAD)])
    counts = [len(PROMPTS[0]) + 1, len(PROMPTS[1])]
    local = tag_groups(local, sum(counts[:rank]))
    local = local.update({"weight_version": torch.tensor(local["oldest_version"], dtype=torch.long)})
    placement = SimpleNamespace(tensor_parallel_size=1, num_groups=2, group_index=rank)
    plan = plan_step(gather_shapes(local, placement, counts), 2, mini_batch_sizes=[6], seed=0)
    layout = SimpleNamespace(dp_rank=rank, replica_ranks=lambda d: [d], replica_group=lambda: None)
    batch = exchange_rows(local, plan, layout, PAD, None, wanted)
    rows = ReplicaRows.from_batch(batch)
    assert rows.toy_row is not None and rows.turn_rewards is None
    return {"rows": plan.replicas[rank], "batch": rows.batch().tensors, "sent": local.tensors,
            "filler_version": local["oldest_version"][-1] if rank == 0 else None}


def test_a_field_added_to_the_table_crosses_the_exchange_and_fills_filler_rows():
    r0, r1 = run_distributed(_exchange_new_fields, world_size=2, timeout=180)
    sent = [r0["sent"], r1["sent"]]
    filler = len(PROMPTS[0])  # rank 0's last row, global id 3
    assert float(sent[0]["toy_row"][filler]) == 0.5  # the table's filler value
    assert r0["filler_version"] == fields.FILLER_VERSION
    assert sorted(r0["rows"] + r1["rows"]) == list(range(6))
    for got in (r0, r1):
        t = got["batch"]
        assert t["toy_row"].dtype == torch.float32 and t["toy_tokens"].dtype == torch.long
        width = t["responses"].shape[1]
        for j, row in enumerate(got["rows"]):
            src, i = (0, row) if row < 4 else (1, row - 4)
            assert float(t["toy_row"][j]) == float(sent[src]["toy_row"][i])
            r = int(t["attention_mask"][j, t["prompts"].shape[1]:].sum())
            assert torch.equal(t["toy_tokens"][j, :r], sent[src]["toy_tokens"][i, :r])
            assert int(t["toy_tokens"][j, r:width].abs().sum()) == 0  # padded with 0 to this replica's width
            assert int(t["weight_version"][j]) == (fields.FILLER_VERSION if row == filler else src)


def test_the_hand_off_refuses_a_field_the_table_lacks_and_a_dtype_it_does_not_say():
    from mcore_agentic.feed import ReplicaRows

    b = 2
    t = hand_off_tensors(b)
    rows = ReplicaRows.from_batch(Batch(tensors=dict(t)))
    assert list(rows.batch().tensors)[5:] == [f.name for f in select(always_fields())]  # the table's order
    with pytest.raises(ValueError, match="toy_row"):
        ReplicaRows.from_batch(Batch(tensors={**t, "toy_row": torch.zeros(b)}))
    with pytest.raises(ValueError, match="seq_scores is torch.float64"):
        ReplicaRows.from_batch(Batch(tensors={**t, "seq_scores": torch.zeros(b, dtype=torch.float64)}))
    with pytest.raises(ValueError, match="lack"):
        ReplicaRows.from_batch(Batch(tensors={k: v for k, v in t.items() if k != "truncated"}))
    with pytest.raises(AttributeError):
        _ = rows.toy_row
