"""Every config in ``configs/`` passes the pre-flight and trains two steps on the tiny model, with data from its
shipped preprocessor or generator.

``gsm8k_multiturn_grpo`` and the base ``ppo_trainer`` run here, in one spawned 2-rank group, on rows that
``launch/preprocess_gsm8k.py`` writes from the shipped sample, and ``meter_pair`` (turn-level credit) on its generated
task; the other two have end-to-end tests of their own
(listed in :data:`COVERED_ELSEWHERE`), and a new config without an entry fails the coverage test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mcore_agentic.config import CONFIG_DIR, compose, load_config
from mcore_agentic.config.paths import REPO_ROOT, search_dirs
from mcore_agentic.trainer.preflight import preflight
from tests.helpers.distributed import run_distributed

SAMPLE = REPO_ROOT / "data" / "gsm8k_sample.jsonl"

TINY = [
    "model=tiny", "trainer.device=cpu", "rollout.name=hf", "data.train_batch_size=4", "rollout.n=2",
    "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=2",
    "data.max_response_length=24", "rollout.multi_turn.max_assistant_turns=2", "trainer.total_training_steps=2",
    "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
    "trainer.plot_at_end=false", "trainer.save_freq=-1", "trainer.resume_mode=disable",
]


def gsm8k_overrides(data: Path, out: Path) -> list[str]:
    return [
        *TINY, f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}", "data.max_prompt_length=1024",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=configs/tools/gsm8k_tool_config.yaml",
        f"trainer.log_dir={out / 'logs'}", f"trainer.default_local_dir={out / 'ckpt'}",
    ]


def meter_pair_overrides(data: Path, out: Path) -> list[str]:
    """The two-meter task (its generator: data.synthetic), turn-level credit as shipped; a short warm start."""
    del data
    return [*TINY, "data.max_response_length=80", "rollout.multi_turn.max_assistant_turns=3",
            "trainer.sft_warmup_steps=2", f"trainer.log_dir={out / 'logs'}", f"trainer.default_local_dir={out / 'ckpt'}"]


RUN_HERE = {"gsm8k_multiturn_grpo": gsm8k_overrides, "ppo_trainer": gsm8k_overrides, "meter_pair": meter_pair_overrides}
COVERED_ELSEWHERE = {
    "default_tiny": "tests/e2e/test_default_job.py (its generator: data.synthetic)",
    "byo_task": "tests/e2e/test_user_task.py (a user's own tool, data and reward function)",
    "harness_tiny": "tests/e2e/test_harness_training.py (Claude Code, Codex CLI and Qwen Code, sandboxed)",
}


def test_every_shipped_config_is_covered():
    shipped = {p.stem for p in CONFIG_DIR.glob("*.yaml")}
    assert shipped == set(RUN_HERE) | set(COVERED_ELSEWHERE), "a config in configs/ has no two-step test"


@pytest.fixture(scope="module")
def gsm8k_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gsm8k")
    done = subprocess.run([sys.executable, str(REPO_ROOT / "launch" / "preprocess_gsm8k.py"), "--train", str(SAMPLE),
                           "--test-size", "4", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def _two_steps(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> list[int]:
    import megatron_patches
    from mcore_agentic.trainer import run

    megatron_patches.apply()
    steps = []
    for name, overrides in runs:
        summary = run(load_config(compose(name, overrides)))
        steps.append(summary.steps)
    return steps


@pytest.mark.timeout(900)
def test_shipped_configs_pass_the_preflight_and_train_two_steps(gsm8k_data, tmp_path):
    runs = [(name, make(gsm8k_data, tmp_path / name)) for name, make in sorted(RUN_HERE.items())]
    for name, overrides in runs:
        assert preflight(load_config(compose(name, overrides)), 2, dirs=search_dirs()) == [], name
    results = run_distributed(_two_steps, 2, (runs,), timeout=840)
    assert results == [[2] * len(runs)] * 2
    for name, _ in runs:
        lines = (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2, name
