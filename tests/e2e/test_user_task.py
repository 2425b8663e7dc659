"""Bring your own task, as a verl user would: a stateful tool, a dataset and a reward function in a directory of
their own, outside the repository, trained from another working directory with the one documented command.

The task: guess a number. ``guess_number`` keeps each conversation's secret and its guesses (``create`` gets the
secret from the row's ``tools_kwargs``), answers higher / lower / correct (verl's ``(text, reward, metrics)`` tuple)
and pays 1 in ``calc_reward`` when a guess was right; its ``execute`` sleeps like a blocking HTTP call would. The
reward function imports a helper module from its own directory. Keys are written as verl names them where verl has
one (``actor_rollout_ref.model.path``, ``...multi_turn.tool_config_path``, ``custom_reward_function.path``/``name``),
paths relative to the working directory. No ``PYTHONPATH``.

The same task with a tool whose server is down (``create`` raises, so every request fails) stops after
``trainer.failure_stop_steps`` steps with one line naming why and exit code 3, the first traceback logged each
step; the run never "succeeds". (A tool whose ``execute`` raises needs a model that calls it: the rollout tests
drive that with a scripted engine, tests/unit/rollout/.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "launch" / "pretrain_rl.py"

TOOL = textwrap.dedent('''
    import time

    from mcore_agentic.tools.base import BaseTool


    class GuessNumberTool(BaseTool):
        """Each conversation has a secret number; a guess is answered higher, lower or correct."""

        def __init__(self, config, tool_schema):
            super().__init__(config, tool_schema)
            self.games = {}
            self.log = config["log"]

        async def create(self, instance_id=None, secret=None, **kwargs):
            if self.config.get("broken"):
                raise RuntimeError("the game server is down")
            self.games[instance_id] = {"secret": int(secret), "guesses": []}
            with open(self.log, "a") as f:
                f.write(f"create {secret}\\n")
            return instance_id

        async def execute(self, instance_id, parameters, **kwargs):
            time.sleep(0.05)  # a blocking call, as requests.get would be
            game = self.games[instance_id]
            guess = int(parameters.get("guess", -1))
            game["guesses"].append(guess)
            if guess == game["secret"]:
                return "correct", 0.1, {}
            return ("higher" if guess < game["secret"] else "lower"), 0.0, {}

        async def calc_reward(self, instance_id, **kwargs):
            return 1.0 if self.games[instance_id]["secret"] in self.games[instance_id]["guesses"] else 0.0

        async def release(self, instance_id, **kwargs):
            self.games.pop(instance_id, None)
''')

TOOLS_YAML = {
    "tools": [{
        "class_name": "guess_tools.GuessNumberTool",
        "config": {"type": "native"},
        "tool_schema": {"type": "function", "function": {
            "name": "guess_number", "description": "Guess the secret number; the answer is higher, lower or correct.",
            "parameters": {"type": "object", "properties": {"guess": {"type": "integer", "description": "your guess"}},
                           "required": ["guess"]}}},
    }],
}

REWARD = textwrap.dedent('''
    from answer_format import final_number


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        with open(extra_info["log"], "a") as f:
            f.write(f"score {ground_truth}\\n")
        return {"score": float(final_number(solution_str) == str(ground_truth)), "acc": 0.0}
''')

HELPER = textwrap.dedent('''
    import re


    def final_number(text):
        found = re.findall(r"-?\\d+", text or "")
        return found[-1] if found else None
''')


def _rows(n: int, log: Path, split: str) -> list[dict]:
    rows = []
    for i in range(n):
        secret = 10 + (7 * i) % 90
        rows.append({
            "data_source": "my_org/guess_number",
            "prompt": [{"role": "system", "content": "Find the secret number with the guess_number tool."},
                       {"role": "user", "content": "Guess my number between 10 and 99, then say it."}],
            "ability": "game",
            "reward_model": {"style": "rule", "ground_truth": str(secret)},
            "extra_info": {"split": split, "index": i, "log": str(log),
                           "tools_kwargs": {"guess_number": {"create_kwargs": {"secret": secret}}}},
        })
    return rows


def write_task(task: Path, log: Path, *, broken: bool = False) -> None:
    task.mkdir(parents=True)
    (task / "guess_tools.py").write_text(TOOL)
    tools = json.loads(json.dumps(TOOLS_YAML))
    tools["tools"][0]["config"].update(log=str(log), broken=broken)
    (task / "tools.yaml").write_text(json.dumps(tools, indent=2))  # JSON is YAML
    (task / "reward.py").write_text(REWARD)
    (task / "answer_format.py").write_text(HELPER)
    for split, n in (("train", 8), ("test", 4)):
        (task / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(n, log, split)))


def command(task_rel: str, out: Path, *extra: str) -> list[str]:
    """The documented command (configs/byo_task.yaml), on the tiny model and two short steps."""
    return [
        sys.executable, str(LAUNCHER), "--nproc_per_node", "2", "--config-name", "byo_task",
        "actor_rollout_ref.model.path=outputs/models/tiny_qwen2", "model.dtype=float32", "model.transformer_impl=local",
        f"data.train_files={task_rel}/train.jsonl", f"data.val_files={task_rel}/test.jsonl",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={task_rel}/tools.yaml",
        f"custom_reward_function.path={task_rel}/reward.py", "custom_reward_function.name=compute_score",
        # small and quick: the tiny model on CPU
        "trainer.device=cpu", "rollout.name=hf", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=512",
        "data.max_response_length=32", "rollout.multi_turn.max_assistant_turns=2", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.plot_at_end=false", f"trainer.log_dir={out / 'logs'}", f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.rollout_data_dir={out / 'dumps'}", "trainer.rollout_data_freq=1", "trainer.save_freq=-1",
        *extra,
    ]


def _env() -> dict[str, str]:
    drop = ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(600)
def test_own_task_trains_with_the_documented_command_from_another_directory(tmp_path):
    log = tmp_path / "calls.log"
    write_task(tmp_path / "my_task", log)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    run = subprocess.run(command("../my_task", tmp_path / "out"), cwd=cwd, env=_env(), capture_output=True, text=True,
                         timeout=540)
    assert run.returncode == 0, run.stderr[-6000:]
    said = run.stdout + run.stderr
    # Each verl key says its native name once (the launcher, not once per rank).
    assert said.count("actor_rollout_ref.model.path -> model.model_path") == 1, said[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    calls = log.read_text().splitlines()
    # Every request created its own game with the row's secret, and every response was scored by the user's function.
    assert sum(c.startswith("create ") for c in calls) == 2 * 4 * 2  # steps x prompts x rollout.n
    assert sum(c.startswith("score ") for c in calls) == 2 * 4 * 2
    # The model saw the tool's schema (byo_task shows tool schemas by default).
    import pyarrow.parquet as pq

    dumps = sorted((tmp_path / "out" / "dumps").rglob("*.parquet"))
    assert dumps, list((tmp_path / "out").rglob("*"))
    prompt = pq.read_table(dumps[0]).to_pylist()[0]
    assert "guess_number" in json.dumps(prompt)


@pytest.mark.timeout(600)
def test_a_tool_that_always_raises_stops_the_run_with_one_line(tmp_path):
    log = tmp_path / "calls.log"
    write_task(tmp_path / "my_task", log, broken=True)
    run = subprocess.run(
        command(str(tmp_path / "my_task"), tmp_path / "out", "trainer.failure_stop_steps=2",
                "trainer.total_training_steps=5"),
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=540,
    )
    said = run.stdout + run.stderr
    assert run.returncode == 3, said[-6000:]
    stop = [line for line in said.splitlines() if line.startswith("error: stopped after step 2")]
    assert len(stop) == 1 and "trainer.failure_stop_steps=0" in stop[0], said[-4000:]
    assert "RuntimeError: the game server is down" in said  # the first traceback of the failing tool, logged
    assert "ChildFailedError" not in said  # the launcher's exit code is the run's; torchrun adds no report
