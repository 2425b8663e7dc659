"""Reduce per-sample values to step metrics; batch-level data, timing and throughput metrics.

Metric names follow verl where one exists (``critic/score/mean``,
``response_length/mean``, ``timing_s/<phase>``, ``perf/throughput``) so dashboards
carry over. :data:`REWARD_KEY` and :data:`RESPONSE_LENGTH_KEY` are what the
end-of-run plots draw.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.stats import Stats

REWARD_KEY = "critic/score/mean"
RESPONSE_LENGTH_KEY = "response_length/mean"
VAL_REWARD_PREFIX = "val/"


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


def scalar(value: Any) -> float | None:
    """A plain float from a python/numpy/torch scalar, or None for anything else (strings, tensors with >1 item)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.reshape(-1)[0])
    return None


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` as floats (NaN/inf kept: hiding them hides divergence)."""
    out = {}
    for k, v in metrics.items():
        f = scalar(v)
        if f is not None:
            out[k] = f
    return out
