"""Claude Code, Codex CLI and Qwen Code, installed from npm and run unmodified from their recipes
(``examples/harnesses``), train a long-context copy of the tiny model: the shipped ``configs/harness_tiny.yaml``,
2 RL steps on 2 gloo ranks (REINFORCE++, one episode per prompt), each row's harness in a bubblewrap sandbox of its own (``rollout.agent.sandbox=bwrap``)
against its session of the endpoint.

The run's real engine is forced to a script (``_harness_job.py``: the harness's shell call, then an answer, with the
real model's log-probs), because a tiny random model would not call a shell tool. Checked: no program fails (no API
error), every episode's shell command ran inside its sandbox (the reward command finds ``hello.txt`` in the work
directory), every trained sample equals an independent re-render of its messages (transformers' own
``apply_chat_template``, not the product's renderer), side requests (Claude Code's title call) are served and counted
but not trained. Skips, with the reason, where the harnesses are not installed or bubblewrap cannot run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_default_job import ROOT

HARNESS_BIN = ROOT / ".harnesses" / "node_modules" / ".bin"
RECIPES = ROOT / "examples" / "harnesses"
TASK = "Create a file hello.txt containing hi using the shell, then say done."
HARNESSES = {"claude_code": "claude", "codex": "codex", "qwen_code": "qwen"}


def _skip_reason() -> str | None:
    missing = [b for b in HARNESSES.values() if not (HARNESS_BIN / b).exists()]
    if missing:
        return f"{missing} not installed under {HARNESS_BIN} (make harnesses: npm install from the registry)"
    import tempfile

    from mcore_agentic.rollout.config import AgentSandboxLimits
    from mcore_agentic.tools.command_sandbox import CommandSandbox
    from mcore_agentic.utils.errors import ConfigError

    try:
        with tempfile.TemporaryDirectory() as probe:
            CommandSandbox(AgentSandboxLimits(memory_cgroup="auto"), sample_dirs=probe).close()
    except ConfigError as exc:
        return f"bubblewrap cannot run here: {exc}"
    return None


@pytest.mark.timeout(600)
def test_three_harnesses_train_two_steps_sandboxed_and_exact(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": TASK}], "data_source": "harness",
        "reward_model": {"ground_truth": "hello.txt"}, "extra_info": {"harness": name}}) + "\n"
        for name in [*HARNESSES, "claude_code"]))  # 4 prompts: 2 per rollout engine
    records = tmp_path / "records"
    records.mkdir()
    overrides = [  # the shipped configs/harness_tiny.yaml (its recipe command, sandbox and reward command), 4 rows
        "--config-name", "harness_tiny", f"data.train_files=[{rows}]",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "trainer.logger=[console,jsonl]",
        # one episode per prompt (the suite's time): an estimator without group statistics still trains on it
        "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus",
        f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"rollout.agent.sample_dirs={tmp_path / 'samples'}",
    ]
    (tmp_path / "samples").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HARNESS_RECORD_DIR": str(records),
           "PWD": str(ROOT)}  # the config's command names its recipe under ${oc.env:PWD}, as `make train` runs it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "e2e" / "_harness_job.py"), *overrides]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]

    metrics = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "agent/episodes" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["agent/episodes"] == 4 and m["agent/program_failures"] == 0 and m["agent/timeouts"] == 0, m
        assert m["reward/mean"] == 1.0, m  # every episode's shell command wrote hello.txt in its sandbox
        assert m["rollout/sanity_check_mismatches"] == 0 and m["agent/forks"] == 0, m
        assert m["agent/side_requests"] >= 2, m  # Claude Code's title call, once per episode
        assert m["agent/trained_samples"] == 4 and m["agent/untrained_samples"] == m["agent/side_samples"], m
        assert m["agent/ignored_fields/context_management"] >= 2 and m["agent/ignored_fields/client_metadata"] >= 1, m
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), m

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "outputs" / "models" / "tiny_long_qwen2"))
    trained = [json.loads(line) for f in sorted(records.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    assert len(trained) == 8
    for r in trained:  # the side calls never reach a trained row; the rows are exactly their re-render
        assert TASK in json.dumps(r["messages"]) and r["tools"], r["messages"][:2]
        text = tok.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids[: len(r["ids"])] == r["ids"] and len(ids) - len(r["ids"]) <= 1, (len(ids), len(r["ids"]))
        assert sum(r["loss_mask"]) > 0
