"""Experience: this replica's rows -> token-level rewards (KL) -> advantages (+ the teacher's term when distilling).

The rows arrive scored (``seq_scores``, by :mod:`mcore_agentic.feed.scoring` on their rollout leader) and
dealt to this replica (:mod:`mcore_agentic.feed.distribute`). :func:`compute_experience`: scores on the last
sampled token, KL-in-reward (the controller sees the global mean), advantages by ``algorithm.adv_estimator``;
whitening and group statistics are all-reduced over DP (``reduce``), so each replica gets
exactly what the whole batch in one place would give its rows. :func:`compute_data_metrics` and
:func:`rollout_vs_train_metrics` say what the experience batch holds (reduced over DP), :func:`throughput_metrics`
how fast the step went.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_agentic.algorithms.advantages import Reduce, compute_advantage
from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.distillation import distillation_advantages, distillation_metrics
from mcore_agentic.algorithms.estimators import estimator
from mcore_agentic.algorithms.kl import apply_kl_penalty
from mcore_agentic.algorithms.sequence_advantages import place_sequence_rewards
from mcore_agentic.algorithms.turn_advantages import TURN_METRIC_TURNS, turn_index
from mcore_agentic.data.batch import Batch
from mcore_agentic.feed import FILLER_VERSION
from mcore_agentic.parallel.stats import Stats


def compute_experience(
    batch: Batch, algo: AlgorithmConfig, kl_ctrl: Any, *, reduce: Reduce | None = None, num_groups: int | None = None
) -> tuple[Batch, dict[str, float]]:
    """Token-level scores, KL-in-reward and advantages/returns of this replica's rows; plus metrics.

    ``reduce`` sums over the DP replicas (None: ``batch`` is the whole step); ``num_groups``: the
    step's prompt groups when ``batch["group_index"]`` holds step-wide integer group ids
    (:func:`mcore_agentic.feed.distribute.tag_groups`), else groups come from ``uid``. With
    ``batch["episode_index"]`` (agent episodes that train several samples; ids below ``num_groups`` too) the group
    statistics count episodes, not rows.
    """
    mask = batch["response_mask"]
    if "turn_rewards" in batch:  # algorithm.turn_rewards: each turn's part at its turn, the episode's at the end
        turns = torch.where(mask.bool(), batch["turn_rewards"], torch.zeros((), dtype=batch["turn_rewards"].dtype))
        scores = place_sequence_rewards(batch["seq_scores"] - turns.sum(-1), mask) + turns
    else:
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
        num_groups=num_groups, reduce=reduce, turn_states=batch["turn_states"] if "turn_states" in batch else None,
        episodes=(batch["episode_index"], num_groups) if "episode_index" in batch and num_groups is not None else None,
        turn_offset=batch["turn_offset"] if "turn_offset" in batch else None,
    )
    if "teacher_log_probs" in batch:  # on-policy distillation (algorithm.distillation)
        d = algo.distillation
        advantages = distillation_advantages(advantages, batch["old_log_probs"], batch["teacher_log_probs"], mask,
                                             mode=d.mode, coef=d.coef, top_k=d.top_k)
        metrics.update(distillation_metrics(batch["old_log_probs"], batch["teacher_log_probs"], mask, reduce=reduce,
                                            turn_offset=batch["turn_offset"] if "turn_offset" in batch else None))
    out = batch.update(
        {"token_level_scores": scores, "token_level_rewards": rewards, "advantages": advantages, "returns": returns}
    )
    if "turn_rewards" in batch or estimator(algo.adv_estimator).turn_level:
        metrics.update(turn_metrics(scores, advantages, mask, reduce=reduce,
                                    turn_offset=batch["turn_offset"] if "turn_offset" in batch else None))
    return out, metrics


def turn_metrics(
    scores: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, reduce: Reduce | None = None,
    turns: int = TURN_METRIC_TURNS, turn_offset: torch.Tensor | None = None,
) -> dict[str, float]:
    """By turn index (the first ``turns``; a sample of a forked agent episode counts from its ``turn_offset``): rows
    that reached it, the mean reward of the turn (its tokens' scores summed) and the mean advantage of its tokens;
    over every replica's rows (``reduce``)."""
    turn = turn_index(mask, turn_offset)
    valid = mask.bool()
    sums = torch.zeros(4, turns, dtype=torch.float64)
    for k in range(turns):
        at = valid & (turn == k)
        rows = at.any(-1)
        sums[0, k] = rows.sum()
        sums[1, k] = (scores * at).sum(-1)[rows].double().sum()
        sums[2, k] = advantages[at].double().sum()
        sums[3, k] = at.sum()
    if reduce is not None:
        sums = reduce(sums)
    out: dict[str, float] = {}
    for k in range(turns):
        if sums[0, k] > 0:
            out[f"turn/rows/{k}"] = float(sums[0, k])
            out[f"turn/reward_mean/{k}"] = float(sums[1, k] / sums[0, k])
            out[f"turn/advantage_mean/{k}"] = float(sums[2, k] / sums[3, k].clamp(min=1))
    return out


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


def compute_data_metrics(batch: Batch, max_response_length: int | None = None, group: Any = None) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of a finished experience batch.

    Uses whichever of the :class:`Batch` keys are present: ``token_level_scores`` /
    ``token_level_rewards`` (summed per sequence), ``advantages``/``returns``/``values``
    (over ``response_mask``), ``prompts`` + ``attention_mask`` (lengths). ``batch`` may be one
    DP replica's rows: the statistics are reduced over ``group`` (the DP group), so every rank
    reports the step's.
    """
    st = Stats()
    names: list[tuple[str, str]] = []
    if "weight_version" in batch and bool((batch["weight_version"] == FILLER_VERSION).any()):
        batch = batch.index((batch["weight_version"] != FILLER_VERSION).nonzero().flatten())  # filler rows: no data
    mask = batch["response_mask"].bool() if "response_mask" in batch else None
    for key, name in (("token_level_scores", "critic/score"), ("token_level_rewards", "critic/rewards")):
        if key in batch:
            st.add(name, batch[key].float().sum(dim=-1))
            names.append((name, name))
    if mask is not None:
        for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
            if key in batch:
                st.add(name, batch[key].float()[mask])
                names.append((name, name))
        st.add("response/policy_tokens", mask.float().sum(dim=-1))
        names.append(("response/policy_tokens", "response/policy_tokens"))
    if "prompts" in batch and "attention_mask" in batch:
        prompt_len = batch["prompts"].shape[-1]
        attention = batch["attention_mask"].float()
        response_lengths = attention[:, prompt_len:].sum(dim=-1)
        st.add("prompt_length", attention[:, :prompt_len].sum(dim=-1))
        st.add("response_length", response_lengths)
        names += [("prompt_length", "prompt_length"), ("response_length", "response_length")]
        if max_response_length:
            st.add("clip", (response_lengths >= max_response_length).float())
    st.reduce(group)
    out: dict[str, float] = {}
    for name, label in names:
        out.update(st.summary(name, label))
    if "clip" in st.sums and st.count("clip"):
        out["response_length/clip_ratio"] = st.mean("clip")
    return out


def throughput_metrics(num_tokens: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """Tokens processed per second for the whole job and per GPU (or CPU process)."""
    if step_seconds <= 0 or world_size <= 0:
        return {}
    total = num_tokens / step_seconds
    return {"perf/total_num_tokens": float(num_tokens), "perf/tokens_per_s": total, "perf/throughput": total / world_size}
