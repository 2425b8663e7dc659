"""The pre-flight: every problem of a run found at once, before a process group, a model or a tool exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mcore_agentic.config import compose, load_config
from mcore_agentic.config.paths import REPO_ROOT, search_dirs
from mcore_agentic.trainer.preflight import preflight

SAMPLE = REPO_ROOT / "data" / "gsm8k_sample.jsonl"


def _gsm8k_data(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "gsm8k"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "launch" / "preprocess_gsm8k.py"), "--train", str(SAMPLE),
                           "--test-size", "4", "--out", str(out), *extra], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def _tiny_gsm8k(data: Path, *overrides: str) -> list[str]:
    return ["model=tiny", "trainer.device=cpu", "rollout.name=hf", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            "trainer.logger=[jsonl]", *overrides]


def test_data_asking_for_an_interaction_the_config_lacks_is_one_line(tmp_path):
    """The shipped preprocessor with --interaction, the shipped config without one: every request would fail."""
    data = _gsm8k_data(tmp_path, "--interaction")
    cfg = load_config(compose("gsm8k_multiturn_grpo", _tiny_gsm8k(data)))
    problems = preflight(cfg, 2, dirs=search_dirs())
    assert [p.field for p in problems] == ["rollout.multi_turn.interaction_config_path"]
    assert "50 of 50 rows" in str(problems[0]) and "'gsm8k'" in str(problems[0])
    # With the interaction configured (or without --interaction) the pair passes.
    cfg = load_config(compose("gsm8k_multiturn_grpo", _tiny_gsm8k(
        data, "rollout.multi_turn.interaction_config_path=configs/interactions/gsm8k_interaction_config.yaml")))
    assert preflight(cfg, 2, dirs=search_dirs()) == []
    cfg = load_config(compose("gsm8k_multiturn_grpo", _tiny_gsm8k(_gsm8k_data(tmp_path / "plain"))))
    assert preflight(cfg, 2, dirs=search_dirs()) == []


def test_every_problem_is_reported_in_one_pass(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "no_such_module.Tool", "config": {}, "tool_schema": {
        "type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {}}}}}]}))
    (tmp_path / "reward.py").write_text("def score(a, b):\n    return 0.0\n")
    cfg = load_config(compose("ppo_trainer", [
        "trainer.device=cpu", f"data.train_files={tmp_path / 'missing.parquet'}",
        f"rollout.multi_turn.tool_config_path={tools}", f"reward.custom_reward_function={tmp_path / 'reward.py'}:score",
        "trainer.logger=[console,wandb]", "actor.ppo_mini_batch_size=3",
    ]))
    problems = {p.field: str(p) for p in preflight(cfg, 2, dirs=search_dirs())}
    assert set(problems) >= {"data.train_files", "reward.custom_reward_function", "actor.ppo_mini_batch_size",
                             f"{tools}: tools[0].class_name"}, problems
    assert "does not exist" in problems["data.train_files"]
    assert "must accept (data_source, solution_str, ground_truth, extra_info)" in problems["reward.custom_reward_function"]
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        assert problems["trainer.logger"].startswith("trainer.logger: wandb is listed but not installed")


def test_a_tool_module_beside_its_yaml_imports_without_pythonpath(tmp_path):
    (tmp_path / "my_counter_tools.py").write_text(
        "from mcore_agentic.tools.base import BaseTool\n\nclass Counter(BaseTool):\n    pass\n")
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [{"class_name": "my_counter_tools.Counter", "tool_schema": {
        "type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {}}}}}]}))
    code = ("from mcore_agentic.tools.registry import load_tools; "
            f"print(sorted(load_tools({str(tmp_path / 'tools.yaml')!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "['count']", done.stderr[-2000:]


def test_prompts_that_cannot_fit_are_found_before_any_model_is_built(tmp_path):
    data = _gsm8k_data(tmp_path)
    cfg = load_config(compose("gsm8k_multiturn_grpo", _tiny_gsm8k(data, "data.max_prompt_length=64")))
    from mcore_agentic.trainer.build import ensure_model

    ensure_model(cfg)  # the tiny checkpoint, for its tokenizer
    problems = [str(p) for p in preflight(cfg, 2, dirs=search_dirs())]
    assert len(problems) == 2 and all(p.startswith("data.max_prompt_length: =64 drops all") for p in problems), problems


def test_an_agent_program_that_cannot_start_is_one_line_and_its_rows_tools_are_its_own(tmp_path):
    base = ["trainer.device=cpu", "rollout.multi_turn.tool_config_path=null", "trainer.logger=[jsonl]"]
    cfg = load_config(compose("default_tiny", [*base, "rollout.agent.entrypoint=examples/no_such_agent.py:run"]))
    problems = preflight(cfg, 2, dirs=search_dirs())
    assert [p.field for p in problems] == ["rollout.agent.entrypoint"], problems  # not the rows' read_meter
    cfg = load_config(compose("default_tiny", [*base, "rollout.agent.command=no-such-agent-binary --x"]))
    assert [str(p) for p in preflight(cfg, 2, dirs=search_dirs())] == [
        "rollout.agent.command: 'no-such-agent-binary' is not an executable on PATH or a path to one"]
    cfg = load_config(compose("default_tiny", [*base, f"rollout.agent.entrypoint={REPO_ROOT}/examples/meter_agent.py:run"]))
    assert preflight(cfg, 2, dirs=search_dirs()) == []
