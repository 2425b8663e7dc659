"""The embedded default job (``make train``), shortened: 2 gloo ranks under torchrun, a few steps.

Runs ``launch/pretrain_rl.py`` with the default config and overrides that only shrink it
(steps, batch, lengths), then checks the artefacts: metrics.jsonl rows with the step
metrics, a TensorBoard event file, the PNG curves, the end-of-run summary, and metrics
that make sense (rewards in [0, 1], engine and trainer log-probs agreeing, finite losses).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Shrinks the default job; every other setting is the embedded default's.
SHORT = [
    "trainer.total_training_steps=3",
    "trainer.sft_warmup_steps=2",
    "trainer.test_freq=2",
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "data.max_response_length=48",
    "data.synthetic.num_val=8",
    "trainer.val_before_train=false",
    "trainer.rollout_data_dir=null",  # the dump tests set their own (tmp) directory
]

STEP_KEYS = (
    "reward/mean", "reward/max", "reward/accuracy", "critic/score/mean", "response_length/mean",
    "rollout/num_turns_mean", "rollout/tool_calls", "rollout/tool_errors", "rollout/sanity_check_mismatches",
    "rollout/template_drift_turns", "timing_s/rollout_event_loop_max_stall",
    "rollout/logprob_diff_max", "rollout/logprob_diff_mean", "actor/entropy", "actor/pg_loss",
    "actor/pg_clipfrac", "actor/grad_norm", "timing_s/gen", "timing_s/update_actor", "timing_s/step",
    "perf/tokens_per_s",
)


def launch(overrides: list[str], *, timeout: float = 300, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node <nproc> launch/pretrain_rl.py <overrides>`` from the repo root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "launch/pretrain_rl.py", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def job_overrides(tmp: Path, extra: list[str] = ()) -> list[str]:
    return [
        "--config-name", "default_tiny",
        *SHORT,
        f"trainer.log_dir={tmp / 'logs'}",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        *extra,
    ]


def read_rows(path: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        rows[record["step"]] = record
    return rows


@pytest.mark.timeout(360)
def test_default_job_short(tmp_path: Path) -> None:
    # data.val_batch_size=3: each rollout group's 4 validation prompts in chunks of 2
    extra = ["trainer.logger=[console,jsonl,tensorboard]", "trainer.save_freq=-1", "data.val_batch_size=3"]
    overrides = [o.replace("val_before_train=false", "val_before_train=true") for o in job_overrides(tmp_path, extra)]
    result = launch(overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    logs = tmp_path / "logs"
    rows = read_rows(logs / "metrics.jsonl")
    assert sorted(rows) == [0, 1, 2, 3]
    assert set(rows.pop(0)) >= {"val/reward/accuracy", "val/reward/mean"}  # the warm-started policy's baseline
    for step, row in rows.items():
        missing = [k for k in STEP_KEYS if k not in row]
        assert not missing, f"step {step} lacks {missing}"
        assert 0.0 <= row["reward/mean"] <= row["reward/max"] <= 1.0
        assert 0.0 <= row["reward/accuracy"] <= 1.0
        assert row["reward/mean"] == pytest.approx(row["critic/score/mean"])
        # The engine holds the actor's weights after every sync: fp32 log-probs agree closely.
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert 0 < row["response_length/mean"] <= 48
        assert row["timing_s/step"] > 0 and row["perf/tokens_per_s"] > 0
    assert "sft/loss_first" in rows[1] and rows[1]["sft/steps"] == 2
    for step in (2, 3):  # test_freq=2, and always at the last step
        assert 0.0 <= rows[step]["val/reward/mean"] <= 1.0
    assert list((logs / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (logs / "reward_curve.png").stat().st_size > 0
    assert (logs / "response_length_curve.png").stat().st_size > 0
    assert "finished 3 RL steps" in result.stdout
    assert "validation accuracy (greedy): after the warm start (step 0)" in result.stdout
    assert "mean reward: first 3 steps" in result.stdout
    # Sanity-check mismatches (a random model samples non-canonical token splits) are one line per step and rollout
    # leader at most, never one warning per rollout call.
    said = result.stdout + result.stderr
    assert "Inconsistent training and inference tokenization" not in said
    summaries = [line for line in said.splitlines() if "tokenization sanity check:" in line]
    assert len(summaries) <= 2 * (3 + 3), summaries  # (3 steps + 3 validations) x 2 leaders


@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_tensor_parallel_actor_and_rollout_groups(tmp_path: Path, rollout_tp: int) -> None:
    """A TP=2 actor (one training replica over both ranks) with rollout TP=1 (two engines, each rolling
    out its own half of the prompts) or rollout TP=2 (one engine on rank 0; rank 1 only joins the
    weight export): every step holds each prompt's samples once, and the engine(s) hold the
    TP-sharded actor's weights after every sync."""
    extra = [
        "actor.tensor_model_parallel_size=2", f"rollout.tensor_model_parallel_size={rollout_tp}",
        "actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=2", "trainer.test_freq=2",
        "trainer.save_freq=-1", "trainer.logger=[console,jsonl]",
    ]
    result = launch(job_overrides(tmp_path, extra))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = read_rows(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["rollout/num_sequences"] == 4 * 2  # data.train_batch_size x rollout.n, no duplicates
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert row["response_length/mean"] > 0
        # the engines' prompt tokens summed over the world (a rank without an engine adds none), and the share of
        # them not prefilled again: a group's samples share their prompt's prefill, later turns reuse earlier ones
        assert row["rollout/prefix_cache_prompt_tokens"] > 0
        rate = row["rollout/prefix_cache_hit_tokens"] / row["rollout/prefix_cache_prompt_tokens"]
        assert 0 < rate < 1 and row["rollout/prefix_cache_hit_rate"] == pytest.approx(rate)
    assert 0.0 <= rows[2]["val/reward/mean"] <= 1.0


def test_ppo_with_critic_reference_and_offload(tmp_path: Path) -> None:
    """The GAE path of the loop: critic warm-up, values, KL loss against the reference, on-policy distillation from a
    teacher of another size (4 layers of hidden 128 against the student's 2 of 64) on its own TP=2 split with the
    top-k KL loss, and every offload switch on (actor during rollout through the sharding manager, critic between
    updates, reference and teacher between uses)."""
    from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset

    teacher = make_tiny_hf_model_from_preset(tmp_path / "teacher", "tiny", num_hidden_layers=4, hidden_size=128,
                                             num_attention_heads=4, intermediate_size=256, seed=7)
    extra = [
        f"teacher.model_path={teacher}", "teacher.param_offload=true", "algorithm.distillation.coef=0.5",
        "algorithm.distillation.top_k=4", "teacher.tensor_model_parallel_size=2",
        "algorithm.adv_estimator=gae", "critic.warmup_steps=1", "critic.ppo_mini_batch_size=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
        "actor.param_offload=true", "actor.grad_offload=true", "actor.optimizer_offload=true",
        "critic.param_offload=true", "critic.optimizer_offload=true", "ref.param_offload=true",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[console,jsonl]",
    ]
    result = launch(job_overrides(tmp_path, extra))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = read_rows(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(rows) == [1, 2]
    assert "critic/vf_loss" in rows[1] and "actor/pg_loss" not in rows[1]  # step 1: critic warm-up only
    assert "actor/pg_loss" in rows[2] and "actor/kl_loss" in rows[2]
    assert rows[2]["actor/kl_loss"] > 0.0  # KL against the warm-started reference, after the first mini-batch
    assert all(rows[s]["sharding/offloaded_mb"] > 0.0 for s in (1, 2))  # actor state left the device for the rollout
    for s in (1, 2):  # the teacher scored every step's sampled tokens, turn by turn
        assert rows[s]["distill/reverse_kl/turn_0"] != 0.0 and "timing_s/teacher" in rows[s]
        assert "distill/reverse_kl" in rows[s]
    assert rows[2]["actor/distill_kl"] > 0.0  # the top-k KL to the teacher entered the actor's loss


def test_rollout_correction_reaches_the_actor_loss(tmp_path: Path) -> None:
    """``algorithm.rollout_correction`` in the trainer: a rejection band that excludes ratio 1 (the HF engine
    samples the trainer's own policy) masks every token out of the actor's loss, so the policy gradient is 0."""
    extra = [
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5",
        "algorithm.rollout_correction.rollout_rs_threshold_lower=0.25",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console,jsonl]",
    ]
    result = launch(job_overrides(tmp_path, extra))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    row = read_rows(tmp_path / "logs" / "metrics.jsonl")[1]
    assert row["rollout_corr/masked_fraction"] == 1.0
    assert row["rollout_corr/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(row["rollout_corr/kl_k1"]) < 1e-4
    assert row["actor/pg_loss"] == 0.0 and row["actor/grad_norm"] == 0.0
