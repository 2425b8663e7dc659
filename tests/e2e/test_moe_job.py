"""The default job on the tiny Qwen3-MoE with its experts split over 2 ranks (``model=tiny_moe
actor.expert_model_parallel_size=2``): rollouts on the synced engine, GRPO updates through the all-to-all
dispatcher, two steps to completion; with routing replay on (``actor.moe.routing_replay=rollout``), so the
engine's routed experts travel with the rows from the rollout leaders to the ranks that train them."""

from __future__ import annotations

import math
from pathlib import Path

from tests.e2e.test_default_job import job_overrides, launch, read_rows


def test_default_job_runs_on_a_mixture_of_experts_at_ep2(tmp_path: Path) -> None:
    extra = ["model=tiny_moe", "actor.expert_model_parallel_size=2", "trainer.total_training_steps=2",
             "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
             "actor.entropy_coeff=0.01", "actor.moe.routing_replay=rollout"]  # a gradient even when the 2-step warm start earns no reward
    result = launch(job_overrides(tmp_path, extra))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = read_rows(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0
        assert row["rollout/num_sequences"] == 8
        assert row["rollout/logprob_diff_max"] < 1e-4  # the engine holds the EP=2 actor's weights (fp32)
        # Expert load over the step's actor passes, summed over both ranks' tokens: 8 experts, top-2.
        assert 1.0 <= row["actor/moe/load_imbalance"] <= row["actor/moe/load_imbalance_max"] <= 4.0
        assert 0 <= row["actor/moe/idle_experts"] <= 16
        # Engine and trainer both fp32 with the same weights: (nearly) every token routes alike.
        assert 0.99 <= row["rollout/routing_agreement"] <= 1.0
