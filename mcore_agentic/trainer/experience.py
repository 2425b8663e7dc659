"""Experience: rollout rows -> sequence scores -> global batch -> token-level rewards (KL) -> advantages.

Order of one step (called by :mod:`.loop`):

1. :func:`score_rollout` (on each rollout leader, over its own rollout): decode each response, call the
   reward function chosen by ``data_source`` (or the custom one), add the tools' rewards and
   the interaction's final score; ``seq_scores`` [B] plus per-sample accuracy.
2. :func:`gather_rollouts` (collective): every rollout group's rollout (its leader's)
   concatenated in group order and re-padded to common widths, so every rank holds the same
   global batch; the training engine's contiguous DP split then hands each replica its rows.
3. :func:`compute_experience`: scores on the last sampled token, KL-in-reward (controller
   updated after), advantages by ``algorithm.adv_estimator`` over whole groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.algorithms.advantages import compute_advantage, place_sequence_rewards
from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.kl import apply_kl_penalty
from mcore_agentic.algorithms.masked import masked_mean
from mcore_agentic.data.batch import Batch, repad_rollout_layout
from mcore_agentic.rewards import score_of

RESPONSE_KEYS = ("responses", "response_mask", "rollout_log_probs")


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
    batch: Batch, reward_fn: Callable[..., Any], tokenizer: Any, extra_infos: Sequence[dict[str, Any]]
) -> Batch:
    """``batch`` plus ``seq_scores`` [B] and meta ``rule_score``/``acc``.

    score = rule reward of ``data_source`` + the request's tool rewards + its interaction's final
    score. ``acc`` is 1 when the rule reward reaches 1.0 (the rule's "correct"), or the rule's own
    ``acc`` when it returns a dict with one. A failed request scores 0. ``extra_infos``: each
    row's ``extra_info`` (the dataset's), passed to the reward function as verl does.
    """
    texts = response_texts(batch, tokenizer)
    scores, rules, accs = [], [], []
    for i, text in enumerate(texts):
        extra = (batch["request_metrics"][i] or {})
        result = reward_fn(batch["data_source"][i], text, batch["ground_truth"][i], dict(extra_infos[i] or {}))
        rule = score_of(result)
        acc = float(result["acc"]) if isinstance(result, dict) and "acc" in result else float(rule >= 1.0)
        interaction = extra.get("interaction_final_score") or 0.0
        total = rule + float(batch["tool_rewards"][i] or 0.0) + float(interaction)
        if extra.get("state") == "failed":
            total, acc = 0.0, 0.0
        scores.append(total)
        rules.append(rule)
        accs.append(acc)
    return batch.update({"seq_scores": torch.tensor(scores, dtype=torch.float32)}, meta={"rule_score": rules, "acc": accs})


# ----------------------------------------------------------------------------------- DP gather
def concat_padded(batches: Sequence[Batch], pad_token_id: int) -> Batch:
    """Rows of all batches in order, re-padded to common widths (see :func:`data.batch.repad_rollout_layout`).

    Other tensors must be ``[B]`` or response-aligned ``[B, R]`` (padded with 0).
    """
    p = max(b["prompts"].shape[1] for b in batches)
    r = max(b["responses"].shape[1] for b in batches)
    repad = dict(pad_token_id=pad_token_id, prompt_width=p, response_width=r)
    return Batch.concat([Batch(repad_rollout_layout(b.tensors, **repad), b.meta, b.info) for b in batches])


def gather_rollouts(local: Batch | None, placement: Any, pad_token_id: int) -> Batch:
    """The global batch (every rollout group's rollout, in group order), identical on every rank.

    Collective over the whole world. ``local`` is the leader's scored rollout of its group's
    prompts, None on the other ranks of the group (they hold no engine, see
    :mod:`mcore_agentic.parallel.rollout_placement`). Advantages are computed on this global
    batch on every rank; the training engine's contiguous DP split then hands each replica its rows.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if local is None:
            raise ValueError("a world of one rank must have rolled out (it is its own rollout leader)")
        return local
    objs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objs, (placement.group_index, local))
    parts = {g: b for g, b in objs if b is not None}
    missing = sorted(set(range(placement.num_groups)) - set(parts))
    if missing:
        raise RuntimeError(f"rollout groups {missing} returned no batch (their leader did not roll out)")
    return concat_padded([parts[g] for g in range(placement.num_groups)], pad_token_id)


def all_reduce_mean(values: dict[str, float], counts: float) -> dict[str, float]:
    """Count-weighted mean over ranks of per-rank means (for validation metrics); identical on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    vec = torch.tensor([values[k] * counts for k in keys] + [counts], dtype=torch.float64)
    dist.all_reduce(vec)
    total = float(vec[-1]) or 1.0
    return {k: float(v) / total for k, v in zip(keys, vec[:-1].tolist())}


# ----------------------------------------------------------------------------------- advantages
def compute_experience(batch: Batch, algo: AlgorithmConfig, kl_ctrl: Any) -> tuple[Batch, dict[str, float]]:
    """Token-level scores, KL-in-reward and advantages/returns of the global batch; plus metrics."""
    mask = batch["response_mask"]
    scores = place_sequence_rewards(batch["seq_scores"], mask)
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward:
        kl = apply_kl_penalty(scores, batch["old_log_probs"], batch["ref_log_probs"], mask, kl_ctrl, algo.kl_penalty)
        rewards = kl.token_level_rewards
        kl_ctrl.update(kl.current_kl, n_steps=len(batch))
        metrics.update({"actor/reward_kl_penalty": kl.current_kl, "actor/reward_kl_penalty_coeff": kl.kl_coef})
    else:
        rewards = scores
    advantages, returns = compute_advantage(
        algo, rewards, mask, values=batch["values"] if "values" in batch else None, index=batch["uid"]
    )
    out = batch.update(
        {"token_level_scores": scores, "token_level_rewards": rewards, "advantages": advantages, "returns": returns}
    )
    return out, metrics


def rollout_vs_train_metrics(batch: Batch) -> dict[str, float]:
    """Max/mean |rollout_log_probs - old_log_probs| on sampled tokens (engine vs trainer numerics)."""
    mask = batch["response_mask"].bool()
    if not mask.any():
        return {}
    diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask]
    out = {"rollout/logprob_diff_max": float(diff.max()), "rollout/logprob_diff_mean": float(diff.mean())}
    if "entropys" in batch:
        out["actor/entropy_rollout"] = float(masked_mean(batch["entropys"], batch["response_mask"]))
    if "ref_log_probs" in batch:
        kl = (batch["old_log_probs"] - batch["ref_log_probs"])[mask]
        out["actor/kl_to_ref"] = float(kl.mean())
    return out


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Reward, accuracy, turns, tool calls/errors, sanity-check mismatches and failures of a global batch."""
    rm = batch["request_metrics"]
    n = max(len(rm), 1)
    scores = batch["seq_scores"]
    out = {
        "rollout/num_sequences": float(len(rm)),
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "reward/accuracy": sum(batch["acc"]) / n,
        "reward/rule_mean": sum(batch["rule_score"]) / n,
        "rollout/num_turns_mean": sum(batch["num_turns"]) / n,
        "rollout/num_turns_max": float(max(batch["num_turns"])),
        "rollout/assistant_turns_mean": sum(m.get("assistant_turns", 0) for m in rm) / n,
        "rollout/tool_calls": float(sum(m.get("tool_calls", 0) for m in rm)),
        "rollout/tool_calls_per_sample": sum(m.get("tool_calls", 0) for m in rm) / n,
        "rollout/tool_errors": float(sum(m.get("tool_errors", 0) for m in rm)),
        "rollout/sanity_check_mismatches": float(sum(m.get("sanity_check_mismatch", 0) for m in rm)),
        "rollout/template_drift_turns": float(sum(m.get("template_drift", 0) for m in rm)),
        "rollout/tokenization_full_context_turns": float(sum(m.get("tokenization_full_context", 0) for m in rm)),
        "rollout/failed_requests": float(sum(m.get("state") == "failed" for m in rm)),
        "rollout/truncated": sum(r == "length" for r in batch["finish_reason"]) / n,
    }
    return out
