"""Experience: scores -> token rewards -> advantages (also over rows spread on DP replicas); rollout metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mcore_agentic.algorithms.advantages import compute_advantage
from mcore_agentic.algorithms.config import ADV_ESTIMATORS, AlgorithmConfig, KLControlConfig
from mcore_agentic.algorithms.kl import build_kl_controller
from mcore_agentic.algorithms.sequence_advantages import group_ids, place_sequence_rewards
from mcore_agentic.algorithms.turn_advantages import turn_spans
from mcore_agentic.data.batch import Batch
from mcore_agentic.feed.scoring import rollout_metrics, rollout_stats
from mcore_agentic.parallel.stats import Stats, sum_over
from mcore_agentic.trainer.experience import compute_experience, rollout_vs_train_metrics

PAD = 0


def _share(prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], uid: str) -> Batch:
    p = max(len(x) for x in prompts)
    r = max(len(x) for x in responses)
    b = len(prompts)
    pt = torch.full((b, p), PAD)
    rt = torch.full((b, r), PAD)
    attn = torch.zeros((b, p + r), dtype=torch.long)
    mt = torch.zeros((b, r), dtype=torch.long)
    for i in range(b):
        pt[i, p - len(prompts[i]):] = torch.tensor(prompts[i])
        attn[i, p - len(prompts[i]):p] = 1
        rt[i, : len(responses[i])] = torch.tensor(responses[i])
        attn[i, p: p + len(responses[i])] = 1
        mt[i, : len(masks[i])] = torch.tensor(masks[i])
    return Batch(
        tensors={"prompts": pt, "responses": rt, "input_ids": torch.cat([pt, rt], 1), "attention_mask": attn,
                 "position_ids": (attn.cumsum(1) - 1).clamp(min=0), "response_mask": mt,
                 "rollout_log_probs": mt.float() * -0.5, "seq_scores": torch.arange(b, dtype=torch.float32)},
        meta={"uid": [uid] * b},
    )


def test_grpo_experience_scores_on_last_sampled_token():
    batch = _share([[1]] * 4, [[2, 3, 4]] * 4, [[1, 0, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], "x")
    batch = batch.update({"seq_scores": torch.tensor([1.0, 0.0, 1.0, 0.0])}, meta={"uid": ["g", "g", "h", "h"]})
    out, metrics = compute_experience(batch, AlgorithmConfig(adv_estimator="grpo"), build_kl_controller(
        AlgorithmConfig().kl_ctrl))
    assert out["token_level_scores"].tolist() == [[0, 0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0]]
    # group g: scores 1, 0 -> mean 0.5, unbiased std 0.7071 -> +-0.7071 on sampled tokens only
    adv = out["advantages"]
    assert adv[0].tolist() == pytest.approx([0.7071, 0.0, 0.7071], abs=1e-3)
    assert adv[1].tolist() == pytest.approx([-0.7071, -0.7071, 0.0], abs=1e-3)
    assert metrics == {}


def test_rollout_vs_train_gap_counts_sampled_tokens_only():
    batch = _share([[1]], [[2, 3, 4]], [[1, 0, 1]], "x")
    batch = batch.update({"rollout_log_probs": torch.tensor([[-1.0, -9.0, -2.0]]),
                          "old_log_probs": torch.tensor([[-1.5, 0.0, -2.0]])})
    m = rollout_vs_train_metrics(batch, group=None)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.5)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.25)
    assert "actor/entropy_rollout" not in m and "actor/kl_to_ref" not in m
    batch = batch.update({"entropys": torch.tensor([[1.0, 50.0, 3.0]]), "ref_log_probs": torch.tensor([[-1.0, 0.0, -3.0]])})
    m = rollout_vs_train_metrics(batch)
    assert m["actor/entropy_rollout"] == pytest.approx(2.0)
    assert m["actor/kl_to_ref"] == pytest.approx((-0.5 + 1.0) / 2)
    # No sampled token anywhere: nothing to report.
    assert rollout_vs_train_metrics(batch.update({"response_mask": torch.zeros(1, 3, dtype=torch.long)})) == {}


# ----------------------------------------------------------------------------------- rows on several replicas
def _simulated_replicas(fns: list[Callable[[Callable[[torch.Tensor], torch.Tensor]], Any]]) -> list[Any]:
    """Run ``fns[r](reduce)`` on one thread per replica; ``reduce`` sums a tensor over all of them (an all-reduce)."""
    n = len(fns)
    barrier = threading.Barrier(n, timeout=30)
    slots: list[torch.Tensor | None] = [None] * n
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def make_reduce(rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0].clone()
            for other in slots[1:]:
                total = total + other  # same order on every replica: bit-identical results
            barrier.wait()
            return total

        return reduce

    def run(rank: int) -> None:
        try:
            results[rank] = fns[rank](make_reduce(rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


B, R = 10, 6
UIDS = ["a", "b", "a", "c", "b", "a", "c", "b", "d", "a"]  # d: a group of one; groups span both replicas
SPLIT = [[0, 3, 4, 7, 8], [1, 2, 5, 6, 9]]  # rows of replica 0 and replica 1


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, R, generator=gen) < 0.7).long()
    mask[3] = 0  # a failed request: no sampled token
    mask[0, 0] = 1
    scores = torch.randint(0, 3, (B,), generator=gen).float() - 0.5
    rewards = place_sequence_rewards(scores, mask)
    rewards = rewards + 0.1 * torch.rand(B, R, generator=gen) * mask  # some per-token shaping too
    values = torch.randn(B, R, generator=gen)
    return rewards, mask, values


def _states(mask: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """gigpo's turn states: per turn one of 3 ids (+1), so step groups span rows, turn indices and replicas."""
    turn, _ = turn_spans(mask)
    per_row_turn = torch.randint(0, 3, (mask.shape[0], mask.shape[1] + 1), generator=torch.Generator().manual_seed(seed))
    return torch.where(turn >= 0, per_row_turn.gather(1, turn.clamp(min=0)) + 1, torch.zeros_like(turn))


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_integer_groups_and_an_identity_reduce_give_the_uid_result(estimator):
    cfg = AlgorithmConfig(adv_estimator=estimator, gamma=0.95, lam=0.9)
    rewards, mask, values = _inputs()
    states = _states(mask)
    gid, num_groups = group_ids(UIDS, B)
    assert num_groups == 4
    want = compute_advantage(cfg, rewards, mask, values=values, index=UIDS, turn_states=states)
    for kwargs in (
        dict(index=gid, num_groups=num_groups),
        dict(index=UIDS, reduce=lambda t: t),
        dict(index=gid, num_groups=num_groups, reduce=lambda t: t),
        dict(index=gid.tolist(), num_groups=num_groups, reduce=sum_over(None)),
        # Ids may leave room for groups this step does not have (another rollout group's prompts).
        dict(index=gid * 3 + 1, num_groups=12, reduce=lambda t: t),
    ):
        got = compute_advantage(cfg, rewards, mask, values=values, turn_states=states, **kwargs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    assert bool((want[0] != 0).any())


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_rows_spread_over_two_replicas_get_the_whole_batch_result(estimator):
    cfg = AlgorithmConfig(adv_estimator=estimator, gamma=0.95, lam=0.9)
    rewards, mask, values = _inputs(seed=1)
    states = _states(mask)
    gid, num_groups = group_ids(UIDS, B)
    want_adv, want_ret = compute_advantage(cfg, rewards, mask, values=values, index=UIDS, turn_states=states)

    def replica(rows):
        return lambda reduce: compute_advantage(
            cfg, rewards[rows], mask[rows], values=values[rows], index=gid[rows], num_groups=num_groups, reduce=reduce,
            turn_states=states[rows],
        )

    outs = _simulated_replicas([replica(rows) for rows in SPLIT])
    for rows, (adv, ret) in zip(SPLIT, outs):
        torch.testing.assert_close(adv, want_adv[rows], atol=1e-6, rtol=0)
        torch.testing.assert_close(ret, want_ret[rows], atol=1e-6, rtol=0)
    # Without the reduce, each replica would see only its own rows: a different answer (the test can fail).
    rows = SPLIT[0]
    alone = compute_advantage(cfg, rewards[rows], mask[rows], values=values[rows], index=gid[rows], num_groups=num_groups,
                              turn_states=states[rows])
    assert not torch.allclose(alone[0], want_adv[rows], atol=1e-3)


def test_group_ids_out_of_range_are_refused():
    cfg = AlgorithmConfig(adv_estimator="grpo")
    rewards, mask, _ = _inputs()
    with pytest.raises(ValueError, match="integer group ids"):
        compute_advantage(cfg, rewards, mask, index=torch.arange(B), num_groups=B - 1)
    with pytest.raises(ValueError, match="integer group ids"):
        compute_advantage(cfg, rewards, mask, index=torch.arange(B) - 1, num_groups=B)


def _experience_batch(seed: int = 2) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    rewards, mask, values = _inputs(seed)
    del rewards
    old = -torch.rand(B, R, generator=gen)
    ref = old - 0.3 * torch.rand(B, R, generator=gen)
    gid, _ = group_ids(UIDS, B)
    return Batch(
        tensors={
            "response_mask": mask, "seq_scores": torch.randint(0, 2, (B,), generator=gen).float(), "values": values,
            "old_log_probs": old, "ref_log_probs": ref, "group_index": gid,
        },
        meta={"uid": list(UIDS)},
    )


@pytest.mark.parametrize("estimator", ["grpo", "gae", "grpo_turn", "gigpo"])
@pytest.mark.parametrize("kl_type", [None, "fixed", "adaptive"])
def test_compute_experience_on_two_replicas_matches_one_batch(estimator, kl_type):
    kl = KLControlConfig(type=kl_type or "fixed", kl_coef=0.2, target_kl=0.01, horizon=20)
    algo = AlgorithmConfig(adv_estimator=estimator, use_kl_in_reward=kl_type is not None, kl_ctrl=kl,
                           turn_rewards=estimator in ("grpo_turn", "gigpo"))
    batch = _experience_batch()
    if algo.turn_rewards:  # per-turn rewards on some sampled tokens (what the scoring places at turn ends)
        gen = torch.Generator().manual_seed(5)
        batch = batch.update({"turn_rewards": 0.5 * torch.rand(B, R, generator=gen) * batch["response_mask"]})
    if estimator == "gigpo":
        batch = batch.update({"turn_states": _states(batch["response_mask"])})
    whole_ctrl = build_kl_controller(kl)
    want, want_metrics = compute_experience(batch, algo, whole_ctrl)
    ctrls = [build_kl_controller(kl) for _ in SPLIT]

    def replica(r):
        return lambda reduce: compute_experience(batch.index(SPLIT[r]), algo, ctrls[r], reduce=reduce, num_groups=4)

    outs = _simulated_replicas([replica(r) for r in range(len(SPLIT))])
    for rows, (out, metrics) in zip(SPLIT, outs):
        for key in ("token_level_scores", "token_level_rewards", "advantages", "returns"):
            torch.testing.assert_close(out[key], want[key][rows], atol=1e-6, rtol=0)
        assert metrics.keys() == want_metrics.keys()
        for k, v in want_metrics.items():
            assert metrics[k] == pytest.approx(v, rel=1e-6)  # the KL is a float32 mean of rows
    # Every replica's controller moved exactly as the one of the whole batch did.
    assert [c.value for c in ctrls] == pytest.approx([whole_ctrl.value] * 2, rel=1e-9)
    if kl_type == "adaptive":
        assert whole_ctrl.value != pytest.approx(0.2)


# ----------------------------------------------------------------------------------- rollout metrics
def _scored(rows: list[dict[str, Any]]) -> Batch:
    return Batch(
        tensors={"seq_scores": torch.tensor([r["score"] for r in rows], dtype=torch.float32)},
        meta={
            "request_metrics": [r["rm"] for r in rows],
            "acc": [r["acc"] for r in rows],
            "rule_score": [r["rule"] for r in rows],
            "num_turns": [r["turns"] for r in rows],
            "finish_reason": [r["finish"] for r in rows],
            "overlong_penalty": [r.get("overlong", 0.0) for r in rows],
            "tool_log": [r.get("tool_log", []) for r in rows],
        },
    )


ROWS = [
    dict(score=1.5, acc=1.0, rule=1.0, turns=3, finish="stop",
         rm={"assistant_turns": 2, "tool_calls": 2, "tool_errors": 1, "template_drift": 1},
         tool_log=[{"error": True, "error_type": "ValueError", "traceback": "Traceback ..."}, {"error": False}]),
    dict(score=0.5, acc=0.0, rule=0.0, turns=1, finish="length", rm=None, overlong=-0.3),
    dict(score=-1.0, acc=0.0, rule=0.5, turns=5, finish="stop",
         rm={"state": "failed", "assistant_turns": 3, "tool_calls": 3, "sanity_check_mismatch": 2,
             "tokenization_full_context": 4},
         tool_log=[{"error": True, "error_type": "TimeoutError"}, {"error": True, "error_type": "invalid_arguments"}]),
]


def test_rollout_metrics_by_hand():
    st = rollout_stats([_scored(ROWS[:2]), _scored(ROWS[2:])])  # two rollout leaders' batches
    m = rollout_metrics(st.reduce(None))
    want = {
        "rollout/num_sequences": 3,
        "reward/mean": 1.0 / 3,
        "reward/max": 1.5,
        "reward/min": -1.0,
        "reward/accuracy": 1.0 / 3,
        "reward/rule_mean": 0.5,
        "rollout/num_turns_mean": 3.0,
        "rollout/num_turns_max": 5,
        "rollout/assistant_turns_mean": 5.0 / 3,
        "rollout/tool_calls": 5,
        "rollout/tool_calls_per_sample": 5.0 / 3,
        "rollout/tool_errors": 1,
        "rollout/sanity_check_mismatches": 2,
        "rollout/template_drift_turns": 1,
        "rollout/tokenization_full_context_turns": 4,
        "rollout/failed_requests": 1,
        "rollout/failed_fraction": 1.0 / 3,
        "rollout/tool_faults": 2,  # the raised ValueError and the timeout; a model's bad arguments are not the tool's
        "rollout/tool_fault_fraction": 2.0 / 5,
        "rollout/tool_broken_requests": 0,  # the faulting requests also had a good call, or failed anyway
        "rollout/truncated": 1.0 / 3,
        "reward/overlong_penalty_mean": -0.1,
    }
    assert m.keys() == want.keys()
    for k, v in want.items():
        assert m[k] == pytest.approx(v), k
    # One leader's batch or both: the same rows give the same metrics.
    assert rollout_metrics(rollout_stats([_scored(ROWS)])) == pytest.approx(m)


def test_rollout_stats_without_rows():
    st = rollout_stats([])  # a rank that is not a rollout leader adds every name with no value
    assert st.count("score") == 0 and st.count("failed") == 0
    assert set(st.sums) == set(rollout_stats([_scored(ROWS)]).sums)  # same names on every rank: reduce lines up
    m = rollout_metrics(st)
    assert m["rollout/num_sequences"] == 0
    assert all(v == 0.0 for v in m.values())


def test_prefix_cache_metrics_are_the_world_sums_and_their_ratio():
    """Each leader adds its engine's prompt and cached tokens of the step; the rate is the ratio of the world's sums
    (not a mean of the leaders' rates), and a rank without an engine adds the names with no value."""
    from mcore_agentic.rollout.engines.base import PrefixCacheStats

    ranks = [rollout_stats([_scored(ROWS[:2])], prefix_cache=PrefixCacheStats(1000, 900)),
             rollout_stats([_scored(ROWS[2:])], prefix_cache=PrefixCacheStats(500, 100)),
             rollout_stats([])]
    assert all(set(st.sums) == set(ranks[0].sums) for st in ranks)  # same names: the all-reduce lines up
    world = Stats()  # what Stats.reduce computes over the ranks
    for st in ranks:
        for name in st.sums:
            world.sums[name] = world.sums.get(name, 0.0) + st.sums[name]
            world.counts[name] = world.counts.get(name, 0.0) + st.counts[name]
            world.maxs[name] = max(world.maxs.get(name, -float("inf")), st.maxs[name])
            world.mins[name] = min(world.mins.get(name, float("inf")), st.mins[name])
    m = rollout_metrics(world)
    assert m["rollout/prefix_cache_prompt_tokens"] == 1500 and m["rollout/prefix_cache_hit_tokens"] == 1000
    assert m["rollout/prefix_cache_hit_rate"] == pytest.approx(1000 / 1500)
    assert "rollout/prefix_cache_hit_rate" not in rollout_metrics(rollout_stats([_scored(ROWS)]))  # nobody counted
    assert PrefixCacheStats(1500, 1000) - PrefixCacheStats(1000, 900) == PrefixCacheStats(500, 100)


# ----------------------------------------------------------------------------------- Stats
def test_stats_reduce_without_a_group_is_a_no_op():
    st = Stats().add("x", torch.tensor([1.0, 2.0, 6.0])).add("x", [3.0]).add("e", [])
    before = (dict(st.sums), dict(st.counts), dict(st.maxs), dict(st.mins))
    assert st.reduce(None) is st and st.reduce(None, world=True) is st
    assert (st.sums, st.counts, st.maxs, st.mins) == before
    assert st.mean("x") == 3.0 and st.max("x") == 6.0 and st.min("x") == 1.0
    assert st.total("x") == 12.0 and st.count("x") == 4


def test_stats_summary_omits_names_with_nothing_counted():
    st = Stats().add("x", [1.0, 3.0]).add("empty", torch.zeros(0))
    assert st.summary("x", "label") == {"label/mean": 2.0, "label/max": 3.0, "label/min": 1.0}
    assert st.summary("x") == {"x/mean": 2.0, "x/max": 3.0, "x/min": 1.0}
    assert st.summary("empty") == {} and st.summary("never_added") == {}
    assert st.mean("empty") == st.max("empty") == st.min("empty") == st.mean("never_added") == 0.0
    assert "empty" in st.sums  # named (every rank must add the same names), but counted 0


def test_sum_over_without_a_group_is_identity():
    t = torch.tensor([1.0, 2.0])
    assert sum_over(None)(t) is t
