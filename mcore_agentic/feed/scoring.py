"""Scoring a leader's rollout, and the rollout's statistics: rows -> sequence scores -> the step's rollout metrics.

:func:`score_rollout` runs on each rollout leader over its own rollout: decode each response, call the reward
function chosen by ``data_source`` (or the custom one), add the tools' rewards and the interaction's final score;
``seq_scores`` [B] plus per-sample accuracy. :func:`rollout_stats` reads the leaders' per-row objects (scores,
turns, tool calls and faults, failures) under fixed names; reduced over the world, :func:`rollout_metrics` turns
them into the step's ``reward/*`` and ``rollout/*`` metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.endpoint.field_policy import IGNORED_METRICS
from mcore_agentic.endpoint.session import FORK_REASONS
from mcore_agentic.parallel.stats import Stats
from mcore_agentic.rewards import score_of
from mcore_agentic.rewards.config import OverlongBufferConfig
from mcore_agentic.rewards.overlong import overlong_penalty
from mcore_agentic.rollout.engines.base import PrefixCacheStats
from mcore_agentic.rollout.failures import is_tool_fault


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
    turn_rewards: bool = False,
) -> Batch:
    """``batch`` plus ``seq_scores`` [B], ``truncated`` [B] (1: the response budget cut it) and meta
    ``rule_score``/``acc``/``overlong_penalty``.

    score = rule reward of ``data_source`` (or the rollout source's own reward, ``source_reward``) + the request's
    tool rewards + its interaction's final score + the over-long penalty (``overlong_buffer`` enabled: DAPO's linear penalty over the last
    ``len`` tokens of ``max_response_length``, on the response's real length). ``acc`` is 1 when the
    rule reward reaches 1.0 (the rule's "correct"), or the rule's own ``acc`` when it returns a dict
    with one. A failed request scores 0. ``extra_infos``: each row's ``extra_info`` (the dataset's),
    passed to the reward function as verl does.

    ``turn_rewards`` (``algorithm.turn_rewards``): the score also counts the interaction's turn scores and the
    reward function's per-turn form (a dict result's ``turn_rewards``: one number per assistant turn, besides its
    ``score``), and ``turn_rewards`` [B, R] holds each assistant turn's own part — its tools' step rewards, the
    turn score of the reply to it, the agent program's reward posted for it (already in ``source_reward``), the
    reward function's number for it — on that turn's last sampled token
    (:func:`turn_reward_tensor`); the rest of the score (the reward function's ``score``, ``calc_reward``, the
    final interaction score, the penalty) is the episode's, which the experience puts on the last sampled token.
    """
    texts = response_texts(batch, tokenizer)
    penalise = overlong_buffer is not None and overlong_buffer.enable
    if penalise and max_response_length is None:
        raise ValueError("the over-long penalty needs max_response_length")
    lengths = batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(1).tolist()
    scores, rules, accs, penalties = [], [], [], []
    fn_turns: list[list[float]] = []
    judged = _episode_judges(batch)
    results: dict[int, Any] = {}

    def result_of(i: int) -> Any:
        """Row ``i``'s reward: the source's, or the reward function's over its episode's last sample."""
        j = judged[i]
        if j not in results:
            given = batch["source_reward"][j] if "source_reward" in batch.meta else None
            program_failed = (batch["request_metrics"][j] or {}).get("agent_program_failed")
            if given is not None:  # the rollout source's own reward (an agent program's)
                results[j] = float(given)
            elif program_failed:
                results[j] = 0.0  # a failed agent program's row trains nothing: no reward function to consult
            else:
                results[j] = reward_fn(batch["data_source"][j], texts[j], batch["ground_truth"][j],
                                       dict(extra_infos[j] or {}))
        return results[j]

    for i in range(len(texts)):
        extra = (batch["request_metrics"][i] or {})
        result = result_of(i)
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
        if turn_rewards:
            own = [float(v) for v in (result.get("turn_rewards") or ())] if isinstance(result, dict) else []
            fn_turns.append(own if judged[i] == i else [])  # an earlier sample's turns are not the ones it scored
            total += sum(batch["turn_interaction_scores"][i] or ()) + sum(own)
        if extra.get("state") == "failed":
            total, acc, penalty = 0.0, 0.0, 0.0
        scores.append(total)
        rules.append(rule)
        accs.append(acc)
        penalties.append(penalty)
    truncated = [int(reason == "length") for reason in batch["finish_reason"]]
    tensors = {"seq_scores": torch.tensor(scores, dtype=torch.float32),
               "truncated": torch.tensor(truncated, dtype=torch.long)}
    if turn_rewards:
        tensors["turn_rewards"] = turn_reward_tensor(batch, fn_turns)
    return batch.update(tensors, meta={"rule_score": rules, "acc": accs, "overlong_penalty": penalties})


def _episode_judges(batch: Batch) -> list[int]:
    """For each row, the row whose response the reward judges: its episode's last sample (an agent episode that
    trains several samples shares one reward), else itself."""
    if "episode_id" not in batch.meta:
        return list(range(len(batch)))
    last = {e: i for i, (e, k, n) in enumerate(zip(batch["episode_id"], batch["episode_sample"],
                                                    batch["episode_samples"])) if k == n - 1}
    return [last.get(e, i) for i, e in enumerate(batch["episode_id"])]


def turn_reward_tensor(batch: Batch, from_reward_fn: Sequence[Sequence[float]] | None = None) -> torch.Tensor:
    """``[B, R]``: each assistant turn's reward (its tools' step rewards, the interaction's score of the reply to
    it, the rollout source's reward for it — an agent program's posts — and, from ``from_reward_fn``, the reward
    function's ``turn_rewards`` for it) on the turn's last sampled
    token; 0 elsewhere, and everywhere on a failed request's row. A turn that sampled nothing, or a reward for a
    turn the row does not have, has no token: it stays with the episode's (the last sampled token)."""
    out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    width = out.shape[1]
    for i in range(len(batch)):
        if (batch["request_metrics"][i] or {}).get("state") == "failed":
            continue
        ends = list(batch["turn_ends"][i] or ())
        parts = [batch["turn_tool_rewards"][i] or (), batch["turn_interaction_scores"][i] or (),
                 (batch.meta.get("turn_source_rewards") or [()] * len(batch))[i] or ()]
        if from_reward_fn is not None:
            parts.append(from_reward_fn[i])
        for part in parts:
            for end, value in zip(ends, part):
                if 0 <= end < width:
                    out[i, end] += float(value)
    return out



def rollout_stats(batches: Sequence[Batch], prefix_cache: PrefixCacheStats | None = None) -> Stats:
    """Per-row rollout values of scored batches (none off a leader), under fixed names: reduce, then :func:`rollout_metrics`.
    ``prefix_cache``: the leader's engine's prompt and cached tokens over the rollout (None: not counted here)."""
    st = Stats()
    # Per engine: prompt tokens it admitted, and those it served from its prefix cache (every rank adds the names).
    st.add("prefix_cache_prompt_tokens", [prefix_cache.prompt_tokens] if prefix_cache is not None else [])
    st.add("prefix_cache_hit_tokens", [prefix_cache.cached_tokens] if prefix_cache is not None else [])
    # Per trained row: what its own tokens and tools did (every sample of an agent episode that trains several).
    every = [(b, i) for b in batches for i in range(len(b))]
    rm = [b["request_metrics"][i] or {} for b, i in every]
    st.add("tool_calls", [m.get("tool_calls", 0) for m in rm])
    st.add("tool_errors", [m.get("tool_errors", 0) for m in rm])
    logs = [(b.meta.get("tool_log") or [[]] * len(b))[i] or [] for b, i in every]
    faults = [sum(is_tool_fault(entry) for entry in log) for log in logs]
    st.add("tool_faults", faults)
    # A request that ran but whose every tool call failed inside the tool: it learned nothing about its task.
    st.add("tool_broken", [float(m.get("state") != "failed" and bool(log) and n == len(log))
                           for m, log, n in zip(rm, logs, faults)])
    st.add("mismatch", [m.get("sanity_check_mismatch", 0) for m in rm])
    st.add("drift", [m.get("template_drift", 0) for m in rm])
    st.add("full_context", [m.get("tokenization_full_context", 0) for m in rm])
    st.add("truncated", [float(b["finish_reason"][i] == "length") for b, i in every])
    st.add("overlong", [float((b.meta.get("overlong_penalty") or [0.0] * len(b))[i]) for b, i in every])
    # Per episode: its result, counted once by its last sample's row.
    rows = [(b, i) for b, i in every if not (b["request_metrics"][i] or {}).get("agent_extra_sample")]
    st.add("agent_extra_samples", [1.0] * (len(every) - len(rows)))
    rm = [b["request_metrics"][i] or {} for b, i in rows]
    st.add("score", [float(b["seq_scores"][i]) for b, i in rows])
    st.add("acc", [b["acc"][i] for b, i in rows])
    st.add("rule", [b["rule_score"][i] for b, i in rows])
    st.add("turns", [b["num_turns"][i] for b, i in rows])
    st.add("assistant_turns", [m.get("assistant_turns", 0) for m in rm])
    st.add("failed", [float(m.get("state") == "failed") for m in rm])
    # Agent programs (rollout.agent): episodes, their samples and forks by reason, the program's faults.
    agent = [m for m in rm if m.get("agent_samples", 0) or m.get("agent_program_failed", 0)]
    st.add("agent_episodes", [1.0] * len(agent))
    st.add("agent_samples", [m.get("agent_samples", 0) for m in agent])
    for reason in FORK_REASONS[1:]:
        st.add(f"agent_fork_{reason}", [(m.get("agent_fork_reasons") or {}).get(reason, 0) for m in agent])
    st.add("agent_malformed_calls", [m.get("agent_malformed_calls", 0) for m in agent])
    st.add("agent_side_requests", [m.get("agent_side_requests", 0) for m in agent])
    st.add("agent_side_samples", [m.get("agent_side_samples", 0) for m in agent])
    for name in IGNORED_METRICS:
        st.add(f"agent_ignored_{name}", [(m.get("agent_ignored_fields") or {}).get(name, 0) for m in agent])
    st.add("agent_program_failed", [m.get("agent_program_failed", 0) for m in agent])
    st.add("agent_timed_out", [m.get("agent_timed_out", 0) for m in agent])
    return st


def rollout_metrics(st: Stats) -> dict[str, float]:
    """Reward, accuracy, turns, tool calls/errors, sanity-check mismatches and failures from :func:`rollout_stats`
    (and, when agent programs rolled out, ``agent/*``). Rewards, turns and failures count episodes (an agent
    episode that trains several samples once); tool calls, truncation and tokenization counts count trained rows."""
    return {**_agent_metrics(st), **_prefix_cache_metrics(st),
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


def _prefix_cache_metrics(st: Stats) -> dict[str, float]:
    """The step's prompt tokens over every engine that counts them, those served from a prefix cache, and the
    ratio of the two sums (none when no engine counted)."""
    if not st.count("prefix_cache_prompt_tokens"):
        return {}
    prompt, hits = st.total("prefix_cache_prompt_tokens"), st.total("prefix_cache_hit_tokens")
    return {"rollout/prefix_cache_prompt_tokens": prompt, "rollout/prefix_cache_hit_tokens": hits,
            "rollout/prefix_cache_hit_rate": hits / prompt if prompt else 0.0}


def _agent_metrics(st: Stats) -> dict[str, float]:
    """Agent programs' episodes: samples per episode, forks by reason, samples not trained, faults (none without)."""
    if not st.total("agent_episodes"):
        return {}
    out = {
        "agent/episodes": st.total("agent_episodes"),
        "agent/samples_per_episode": st.mean("agent_samples"),
        "agent/untrained_samples": st.total("agent_samples") + st.total("agent_side_samples")
        - st.total("agent_episodes")
        + st.total("agent_program_failed") - st.total("agent_extra_samples"),
        "agent/trained_samples": st.total("agent_episodes") - st.total("agent_program_failed")
        + st.total("agent_extra_samples"),
        "agent/forks": sum(st.total(f"agent_fork_{r}") for r in FORK_REASONS[1:]),
        "agent/malformed_calls": st.total("agent_malformed_calls"),
        "agent/side_requests": st.total("agent_side_requests"),
        "agent/side_samples": st.total("agent_side_samples"),
        "agent/program_failures": st.total("agent_program_failed"),
        "agent/timeouts": st.total("agent_timed_out"),
    }
    out.update({f"agent/fork_{r}": st.total(f"agent_fork_{r}") for r in FORK_REASONS[1:]})
    out.update({f"agent/ignored_fields/{n}": st.total(f"agent_ignored_{n}") for n in IGNORED_METRICS
                if st.total(f"agent_ignored_{n}")})
    return out
