"""Experience: rollout rows -> sequence scores -> this replica's rows -> token-level rewards (KL) -> advantages.

Order of one step (called by :mod:`.loop`):

1. :func:`score_rollout` (on each rollout leader, over its own rollout): decode each response, call the
   reward function chosen by ``data_source`` (or the custom one), add the tools' rewards and
   the interaction's final score; ``seq_scores`` [B] plus per-sample accuracy.
   :func:`rollout_metrics` reads the leaders' per-row objects there, reduced over the world.
2. :mod:`.distribute` (collective): each DP replica receives its rows, tensors only.
3. :func:`compute_experience` on each replica's rows: scores on the last sampled token,
   KL-in-reward (the controller sees the global mean), advantages by ``algorithm.adv_estimator``;
   whitening and group statistics are all-reduced over DP (``reduce``), so each replica gets
   exactly what the whole batch in one place would give its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mcore_agentic.algorithms.advantages import Reduce, compute_advantage, place_sequence_rewards
from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.kl import apply_kl_penalty
from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.stats import Stats
from mcore_agentic.rewards import score_of
from mcore_agentic.rewards.config import OverlongBufferConfig
from mcore_agentic.rewards.overlong import overlong_penalty
from mcore_agentic.trainer.run_health import is_tool_fault


# ----------------------------------------------------------------------------------- rewards
def response_texts(batch: Batch, tokenizer: Any) -> list[str]:
    """Each row's response (all turns after the prompt, tool results included) as text, padding removed."""
    prompt_len = batch["prompts"].shape[1]
    attn = batch["attention_mask"][:, prompt_len:]
    out = []
    for ids, mask in zip(batch["responses"], attn):
        out.append(tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=False))
    return out


def score_rollout(
    batch: Batch,
    reward_fn: Callable[..., Any],
    tokenizer: Any,
    extra_infos: Sequence[dict[str, Any]],
    *,
    overlong_buffer: OverlongBufferConfig | None = None,
    max_response_length: int | None = None,
) -> Batch:
    """``batch`` plus ``seq_scores`` [B], ``truncated`` [B] (1: the response budget cut it) and meta
    ``rule_score``/``acc``/``overlong_penalty``.

    score = rule reward of ``data_source`` + the request's tool rewards + its interaction's final
    score + the over-long penalty (``overlong_buffer`` enabled: DAPO's linear penalty over the last
    ``len`` tokens of ``max_response_length``, on the response's real length). ``acc`` is 1 when the
    rule reward reaches 1.0 (the rule's "correct"), or the rule's own ``acc`` when it returns a dict
    with one. A failed request scores 0. ``extra_infos``: each row's ``extra_info`` (the dataset's),
    passed to the reward function as verl does.
    """
    texts = response_texts(batch, tokenizer)
    penalise = overlong_buffer is not None and overlong_buffer.enable
    if penalise and max_response_length is None:
        raise ValueError("the over-long penalty needs max_response_length")
    lengths = batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(1).tolist()
    scores, rules, accs, penalties = [], [], [], []
    for i, text in enumerate(texts):
        extra = (batch["request_metrics"][i] or {})
        result = reward_fn(batch["data_source"][i], text, batch["ground_truth"][i], dict(extra_infos[i] or {}))
        rule = score_of(result)
        acc = float(result["acc"]) if isinstance(result, dict) and "acc" in result else float(rule >= 1.0)
        interaction = extra.get("interaction_final_score") or 0.0
        penalty = 0.0
        if penalise:
            assert overlong_buffer is not None and max_response_length is not None
            penalty = overlong_penalty(
                int(lengths[i]), max_response_length, overlong_buffer.len, overlong_buffer.penalty_factor
            )
        total = rule + float(batch["tool_rewards"][i] or 0.0) + float(interaction) + penalty
        if extra.get("state") == "failed":
            total, acc, penalty = 0.0, 0.0, 0.0
        scores.append(total)
        rules.append(rule)
        accs.append(acc)
        penalties.append(penalty)
    truncated = [int(reason == "length") for reason in batch["finish_reason"]]
    return batch.update(
        {"seq_scores": torch.tensor(scores, dtype=torch.float32), "truncated": torch.tensor(truncated, dtype=torch.long)},
        meta={"rule_score": rules, "acc": accs, "overlong_penalty": penalties},
    )


# ----------------------------------------------------------------------------------- advantages
def compute_experience(
    batch: Batch, algo: AlgorithmConfig, kl_ctrl: Any, *, reduce: Reduce | None = None, num_groups: int | None = None
) -> tuple[Batch, dict[str, float]]:
    """Token-level scores, KL-in-reward and advantages/returns of this replica's rows; plus metrics.

    ``reduce`` sums over the DP replicas (None: ``batch`` is the whole step); ``num_groups``: the
    step's prompt groups when ``batch["group_index"]`` holds step-wide integer group ids
    (:func:`mcore_agentic.trainer.distribute.tag_groups`), else groups come from ``uid``.
    """
    mask = batch["response_mask"]
    scores = place_sequence_rewards(batch["seq_scores"], mask)
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward:
        kl = apply_kl_penalty(scores, batch["old_log_probs"], batch["ref_log_probs"], mask, kl_ctrl, algo.kl_penalty)
        rewards = kl.token_level_rewards
        # current_kl is a mean over rows: the global one weighs every replica by its rows.
        rows_kl = torch.tensor([kl.current_kl * len(batch), float(len(batch))], dtype=torch.float64)
        if reduce is not None:
            rows_kl = reduce(rows_kl)
        current = float(rows_kl[0] / rows_kl[1].clamp(min=1))
        kl_ctrl.update(current, n_steps=int(rows_kl[1]))
        metrics.update({"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": kl.kl_coef})
    else:
        rewards = scores
    index = batch["group_index"] if num_groups is not None else batch["uid"]
    advantages, returns = compute_advantage(
        algo, rewards, mask, values=batch["values"] if "values" in batch else None, index=index,
        num_groups=num_groups, reduce=reduce,
    )
    out = batch.update(
        {"token_level_scores": scores, "token_level_rewards": rewards, "advantages": advantages, "returns": returns}
    )
    return out, metrics


def rollout_vs_train_metrics(batch: Batch, group: Any = None) -> dict[str, float]:
    """Max/mean |rollout_log_probs - old_log_probs| on sampled tokens (engine vs trainer numerics), entropy and
    KL to the reference; over this replica's rows, reduced over ``group`` (the DP group)."""
    mask = batch["response_mask"].bool()
    st = Stats().add("diff", (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask])
    if "entropys" in batch:
        st.add("entropy", batch["entropys"][mask])
    if "ref_log_probs" in batch:
        st.add("kl", (batch["old_log_probs"] - batch["ref_log_probs"])[mask])
    st.reduce(group)
    if not st.count("diff"):
        return {}
    out = {"rollout/logprob_diff_max": st.max("diff"), "rollout/logprob_diff_mean": st.mean("diff")}
    if "entropys" in batch:
        out["actor/entropy_rollout"] = st.mean("entropy")
    if "ref_log_probs" in batch:
        out["actor/kl_to_ref"] = st.mean("kl")
    return out


def rollout_stats(batches: Sequence[Batch]) -> Stats:
    """Per-row rollout values of scored batches (none off a leader), under fixed names: reduce, then :func:`rollout_metrics`."""
    st = Stats()
    rows = [(b, i) for b in batches for i in range(len(b))]
    rm = [b["request_metrics"][i] or {} for b, i in rows]
    st.add("score", [float(b["seq_scores"][i]) for b, i in rows])
    st.add("acc", [b["acc"][i] for b, i in rows])
    st.add("rule", [b["rule_score"][i] for b, i in rows])
    st.add("turns", [b["num_turns"][i] for b, i in rows])
    st.add("assistant_turns", [m.get("assistant_turns", 0) for m in rm])
    st.add("tool_calls", [m.get("tool_calls", 0) for m in rm])
    st.add("tool_errors", [m.get("tool_errors", 0) for m in rm])
    logs = [(b.meta.get("tool_log") or [[]] * len(b))[i] or [] for b, i in rows]
    faults = [sum(is_tool_fault(entry) for entry in log) for log in logs]
    st.add("tool_faults", faults)
    # A request that ran but whose every tool call failed inside the tool: it learned nothing about its task.
    st.add("tool_broken", [float(m.get("state") != "failed" and bool(log) and n == len(log))
                           for m, log, n in zip(rm, logs, faults)])
    st.add("mismatch", [m.get("sanity_check_mismatch", 0) for m in rm])
    st.add("drift", [m.get("template_drift", 0) for m in rm])
    st.add("full_context", [m.get("tokenization_full_context", 0) for m in rm])
    st.add("failed", [float(m.get("state") == "failed") for m in rm])
    st.add("truncated", [float(b["finish_reason"][i] == "length") for b, i in rows])
    st.add("overlong", [float((b.meta.get("overlong_penalty") or [0.0] * len(b))[i]) for b, i in rows])
    return st


def rollout_metrics(st: Stats) -> dict[str, float]:
    """Reward, accuracy, turns, tool calls/errors, sanity-check mismatches and failures from :func:`rollout_stats`."""
    return {
        "rollout/num_sequences": st.count("score"),
        "reward/mean": st.mean("score"),
        "reward/max": st.max("score"),
        "reward/min": st.min("score"),
        "reward/accuracy": st.mean("acc"),
        "reward/rule_mean": st.mean("rule"),
        "rollout/num_turns_mean": st.mean("turns"),
        "rollout/num_turns_max": st.max("turns"),
        "rollout/assistant_turns_mean": st.mean("assistant_turns"),
        "rollout/tool_calls": st.total("tool_calls"),
        "rollout/tool_calls_per_sample": st.mean("tool_calls"),
        "rollout/tool_errors": st.total("tool_errors"),
        "rollout/sanity_check_mismatches": st.total("mismatch"),
        "rollout/template_drift_turns": st.total("drift"),
        "rollout/tokenization_full_context_turns": st.total("full_context"),
        "rollout/failed_requests": st.total("failed"),
        "rollout/failed_fraction": st.mean("failed"),
        "rollout/tool_faults": st.total("tool_faults"),
        "rollout/tool_broken_requests": st.total("tool_broken"),
        "rollout/tool_fault_fraction": st.total("tool_faults") / st.total("tool_calls") if st.total("tool_calls") else 0.0,
        "rollout/truncated": st.mean("truncated"),
        "reward/overlong_penalty_mean": st.mean("overlong"),
    }
