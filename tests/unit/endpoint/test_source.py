"""Agent programs as a rollout source: rows like the built-in loop's, rewards from the program, failures contained.

A real :class:`AgentSource` (uvicorn on loopback, the openai client inside the programs) on a scripted engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import sys
import time
from typing import Any

import pytest

from mcore_agentic.endpoint.source import AgentSource
from mcore_agentic.feed.scoring import rollout_metrics, rollout_stats, score_rollout
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import AgentConfig, MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import finish_batch, generate_sequences, run_sync
from mcore_agentic.rollout.source import Budget, roll_to_end
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.utils.errors import ConfigError
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call

SCRIPTS = {"Q-add": [call("add", a=2, b=3), "The answer is 5."]}
ADD = AddTool().get_openai_tool_schema()
ROWS = [{"prompt": [{"role": "system", "content": "You can use tools."}, {"role": "user", "content": f"Q-add {i}"}],
         "data_source": "test", "reward_model": {"ground_truth": "5"}} for i in range(2)]


async def _converse(base_url: str, api_key: str, row: dict[str, Any], *, rewrite: bool = False,
                    reply_ids: list[str] | None = None) -> list[dict]:
    from openai import AsyncOpenAI

    messages = list(row["prompt"])
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
            if reply_ids is not None:
                reply_ids.append(reply.id)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return messages
            for c in message.tool_calls:
                args = json.loads(c.function.arguments)
                messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
            if rewrite:  # compaction: the system prompt is dropped
                messages = messages[1:]


async def agent_ok(base_url: str, api_key: str, row: dict[str, Any]) -> dict[str, float]:
    messages = await _converse(base_url, api_key, row)
    return {"score": float("5" in messages[-1]["content"]), "format": 0.5}


async def agent_compacts(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    await _converse(base_url, api_key, row, rewrite=True)
    return 1.0


async def agent_posts_reward(base_url: str, api_key: str, row: dict[str, Any]) -> None:
    import httpx

    await _converse(base_url, api_key, row)
    root = base_url.rsplit("/v1", 1)[0]
    async with httpx.AsyncClient() as client:
        for value in (0.25, 0.5):
            r = await client.post(f"{root}/reward", json={"reward": value}, headers={"Authorization": f"Bearer {api_key}"})
            r.raise_for_status()


async def agent_rewards_turns(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Rewards its first turn by the id the client got and its last as ``latest``; its episode reward is 1."""
    import httpx

    ids: list[str] = []
    await _converse(base_url, api_key, row, reply_ids=ids)
    root, auth = base_url.rsplit("/v1", 1)[0], {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient() as client:
        for body in ({"reward": 0.25, "turn": ids[0]}, {"reward": 0.5, "turn": "latest"}, {"reward": 0.125}):
            (await client.post(f"{root}/reward", json=body, headers=auth)).raise_for_status()
        bad = await client.post(f"{root}/reward", json={"reward": 1.0, "turn": "chatcmpl-nosuch"}, headers=auth)
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "turn", bad.text
        bad = await client.post(f"{root}/reward", json={"reward": 1.0, "turn": 3}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "turn", bad.text
    return 1.0


async def agent_raises(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    await _converse(base_url, api_key, row)
    raise RuntimeError("the harness crashed")


async def agent_hangs(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    await asyncio.sleep(3600)
    return 1.0


def agent_returns_garbage(base_url: str, api_key: str, row: dict[str, Any]) -> str:  # a blocking (sync) program
    return "great job"


@pytest.fixture(scope="module")
def tok():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def _roll(tok: Any, entrypoint: str | None = None, n: int = 2, **agent: Any):
    cfg = RolloutConfig(prompt_length=512, response_length=512, n=n, seed=7,
                        multi_turn=MultiTurnConfig(max_assistant_turns=5),
                        agent=AgentConfig(entrypoint=entrypoint, **agent))
    source = AgentSource(cfg, ScriptedEngine(tok, SCRIPTS), ChatTokenizer(tok), version=lambda: 3)
    try:
        return source.roll_out(ROWS, cfg), cfg
    finally:
        source.close()


def test_program_rows_equal_the_built_in_loops_and_carry_the_programs_reward(tok):
    batch, cfg = _roll(tok, "tests.unit.endpoint.test_source:agent_ok")
    loop_cfg = RolloutConfig(prompt_length=512, response_length=512, n=2, seed=7,
                             multi_turn=MultiTurnConfig(max_assistant_turns=5))
    loop = run_sync(generate_sequences(ROWS, ScriptedEngine(tok, SCRIPTS), {"add": AddTool()}, None, loop_cfg, tok))
    assert batch["input_ids"].tolist() == loop["input_ids"].tolist()
    assert batch["response_mask"].tolist() == loop["response_mask"].tolist()
    assert batch["rollout_log_probs"].tolist() == loop["rollout_log_probs"].tolist()
    assert len(set(batch["uid"])) == 2 and batch["uid"][0] == batch["uid"][1]  # rollout.n sessions per prompt
    assert batch["source_reward"] == [1.0] * 4
    assert [m["agent_samples"] for m in batch["request_metrics"]] == [1] * 4
    assert all(m["sanity_check_mismatch"] == 0 for m in batch["request_metrics"])
    versions = batch["rollout_log_probs"]  # the weight version each sampled token records is the source's
    assert versions.shape[0] == 4
    scored = score_rollout(batch, lambda *a: 0.0, tok, [{}] * 4)
    assert scored["seq_scores"].tolist() == [1.0] * 4  # the program's reward, not the reward function's


def test_a_forked_episode_trains_every_sample_as_one_episode(tok):
    batch, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_compacts", n=1)
    assert len(batch) == 4  # two prompts, each an episode of two samples: the earlier one right before the last
    assert batch["episode_sample"] == [0, 1, 0, 1] and batch["episode_samples"] == [2] * 4
    assert batch["episode_id"][0] == batch["episode_id"][1] != batch["episode_id"][2] == batch["episode_id"][3]
    assert batch["uid"][0] == batch["uid"][1] and batch["source_reward"] == [1.0] * 4
    for i, (m, messages) in enumerate(zip(batch["request_metrics"], batch["messages"])):
        assert m["state"] == "completed" and m["sanity_check_mismatch"] == 0
        assert int(batch["response_mask"][i].sum()) > 0  # every sample trains its own sampled tokens
        if i % 2:  # the last sample: the compacted history is its prompt, its turn the answer
            assert m["agent_samples"] == 2 and m["agent_fork_reasons"] == {"rewritten": 1}
            assert messages[0]["role"] == "user" and messages[-1]["content"] == "The answer is 5."
        else:  # the earlier sample: the system prompt, its turn the tool call
            assert m["agent_extra_sample"] == 1
            assert messages[0]["role"] == "system" and messages[-1]["tool_calls"]
    scored = score_rollout(batch, lambda *a: 0.0, tok, [{}] * 4)
    assert scored["seq_scores"].tolist() == [1.0] * 4
    metrics = rollout_metrics(rollout_stats([scored]))
    assert metrics["rollout/num_sequences"] == 2 and metrics["reward/mean"] == 1.0  # episodes, not rows
    assert (metrics["agent/episodes"], metrics["agent/trained_samples"], metrics["agent/untrained_samples"]) == (2, 4, 0)


def test_train_samples_last_trains_only_the_last_sample(tok):
    batch, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_compacts", n=1, train_samples="last")
    assert len(batch) == 2 and batch["episode_samples"] == [1, 1]
    for m, messages in zip(batch["request_metrics"], batch["messages"]):
        assert m["agent_samples"] == 2 and messages[-1]["content"] == "The answer is 5."
    metrics = rollout_metrics(rollout_stats([score_rollout(batch, lambda *a: 0.0, tok, [{}] * 2)]))
    assert (metrics["agent/trained_samples"], metrics["agent/untrained_samples"]) == (2, 2)


def test_the_reward_function_judges_an_episode_by_its_last_sample(tok):
    batch, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_compacts", n=1, reward="reward_fn")
    judged: list[str] = []

    def reward_fn(source, text, truth, extra):
        judged.append(text)
        return float("The answer is 5." in text)

    scored = score_rollout(batch, reward_fn, tok, [{}] * 4)
    assert len(judged) == 2 and scored["seq_scores"].tolist() == [1.0] * 4  # once per episode, shared by its samples


def test_rewards_posted_to_the_session_add_up(tok):
    batch, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_posts_reward", n=1)
    assert batch["source_reward"] == [0.75, 0.75]


def test_rewards_posted_for_a_turn_reach_that_turns_last_sampled_token(tok):
    batch, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_rewards_turns", n=1)
    loop_cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                             multi_turn=MultiTurnConfig(max_assistant_turns=5))
    loop = run_sync(generate_sequences(ROWS, ScriptedEngine(tok, SCRIPTS), {"add": AddTool()}, None, loop_cfg, tok))
    assert batch["turn_ends"] == loop["turn_ends"]  # the program's turns end where the built-in loop's do
    assert batch["source_reward"] == [1.875, 1.875]  # every post adds up; failed posts touch nothing
    assert batch["turn_source_rewards"] == [[0.25, 0.5], [0.25, 0.5]]
    scored = score_rollout(batch, lambda *a: 0.0, tok, [{}] * 2, turn_rewards=True)
    assert scored["seq_scores"].tolist() == [1.875, 1.875]  # the per-turn parts are counted once
    for i, (first, last) in enumerate(batch["turn_ends"]):
        placed = scored["turn_rewards"][i]
        assert placed[first].item() == 0.25 and placed[last].item() == 0.5 and placed.sum().item() == 0.75
        mask = batch["response_mask"][i]
        assert mask[first] == 1 and mask[last] == 1 and mask[first + 1] == 0  # each turn's last sampled token


@pytest.mark.parametrize("entry,kind", [("agent_raises", "RuntimeError"), ("agent_returns_garbage", "BadReward"),
                                        ("agent_hangs", "TimeoutError")])
def test_a_failing_program_fails_its_row_not_the_rollout(tok, entry, kind):
    batch, _ = _roll(tok, f"tests.unit.endpoint.test_source:{entry}", n=1, timeout_s=1.0)
    assert [m["state"] for m in batch["request_metrics"]] == ["failed", "failed"]
    assert [m["error_type"] for m in batch["request_metrics"]] == [kind, kind]
    assert batch["response_mask"].sum() == 0  # trains on nothing
    if entry == "agent_hangs":
        assert [m["agent_timed_out"] for m in batch["request_metrics"]] == [1, 1]

    def no_rule(*args: Any) -> float:  # the run's reward function knows no rule for a harness task's data source
        raise ConfigError("data_source", "no built-in reward rule")

    scored = score_rollout(batch, no_rule, tok, [{}] * len(batch))  # a failed program's row scores 0, not a crash
    assert scored["seq_scores"].tolist() == [0.0, 0.0]


def test_a_command_program_gets_the_endpoint_in_its_environment(tok, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(  # only the openai client: a command is its own process, it imports no trainer code
        "import json, os, sys\n"
        "from openai import OpenAI\n"
        "row = json.load(open(os.environ['MCORE_AGENTIC_ROW']))\n"
        "assert row == json.load(sys.stdin)\n"
        "client = OpenAI(base_url=os.environ['OPENAI_BASE_URL'], api_key=os.environ['OPENAI_API_KEY'], max_retries=0)\n"
        f"tools = [{ADD!r}]\n"
        "messages = list(row['prompt'])\n"
        "while True:\n"
        "    m = client.chat.completions.create(model='p', messages=messages, tools=tools).choices[0].message\n"
        "    messages.append(m.model_dump(exclude_none=True))\n"
        "    if not m.tool_calls:\n"
        "        break\n"
        "    for c in m.tool_calls:\n"
        "        a = json.loads(c.function.arguments)\n"
        "        messages.append({'role': 'tool', 'tool_call_id': c.id, 'content': str(a['a'] + a['b'])})\n"
        "print('log lines may come first')\n"
        "print(json.dumps({'score': 1.0}))\n"
    )
    batch, _ = _roll(tok, None, n=1, command=f"{sys.executable} {script}")
    assert [m["state"] for m in batch["request_metrics"]] == ["completed", "completed"]
    assert batch["source_reward"] == [1.0, 1.0]


def test_an_entrypoint_that_cannot_load_is_one_line(tok):
    with pytest.raises(ConfigError) as e:
        _roll(tok, "tests.unit.endpoint.test_source:nope")
    assert "rollout.agent.entrypoint" in str(e.value)


def test_agent_metrics_count_episodes_samples_forks_and_faults(tok):
    from mcore_agentic.feed.scoring import rollout_metrics, rollout_stats

    forked, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_compacts", n=1)
    failed, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_raises", n=1)
    batches = [score_rollout(b, lambda *a: 0.0, tok, [{}] * len(b)) for b in (forked, failed)]
    m = rollout_metrics(rollout_stats(batches))
    assert m["agent/episodes"] == 4 and m["agent/samples_per_episode"] == 1.5  # 2 + 2 + 1 + 1 samples
    assert m["agent/fork_rewritten"] == 2 and m["agent/forks"] == 2
    assert m["agent/program_failures"] == 2
    assert m["agent/untrained_samples"] == 2  # the failed episodes' samples (the forked ones train: train_samples=all)
    assert m["agent/trained_samples"] == 4
    loop = run_sync(generate_sequences(ROWS, ScriptedEngine(tok, SCRIPTS), {"add": AddTool()}, None,
                                       RolloutConfig(prompt_length=512, response_length=512), tok))
    loop = score_rollout(loop, lambda *a: 0.0, tok, [{}] * len(loop))
    assert not any(k.startswith("agent/") for k in rollout_metrics(rollout_stats([loop])))


def test_routing_is_recorded_per_sample_as_the_loop_records_it(tok):
    cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                        multi_turn=MultiTurnConfig(max_assistant_turns=5),
                        agent=AgentConfig(entrypoint="tests.unit.endpoint.test_source:agent_ok"))
    source = AgentSource(cfg, ScriptedEngine(tok, SCRIPTS, routing=True), ChatTokenizer(tok), version=lambda: 0)
    try:
        batch = source.roll_out(ROWS, cfg)
    finally:
        source.close()
    loop_cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                             multi_turn=MultiTurnConfig(max_assistant_turns=5))
    loop = run_sync(generate_sequences(ROWS, ScriptedEngine(tok, SCRIPTS, routing=True), {"add": AddTool()}, None,
                                       loop_cfg, tok))
    assert batch["routed_experts"].shape == loop["routed_experts"].shape
    assert (batch["routed_experts"][..., 0] == loop["routed_experts"][..., 0]).all()  # token ids and positions


def test_dumps_carry_an_episodes_samples_and_forks(tok):
    from mcore_agentic.feed.rollout_dump import trajectory_table

    batch, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_compacts", n=1)
    scored = score_rollout(batch, lambda *a: 0.0, tok, [{}] * len(batch))
    table = trajectory_table(scored, [0, 1, 3], step=1, split="train", group=0, weight_version=0, tokenizer=tok)
    assert table.column("agent_samples").to_pylist() == [None, 2, 2]  # the episode's counts are on its last row
    assert [json.loads(f) for f in table.column("agent_forks").to_pylist()[1:]] == [{"rewritten": 1}] * 2
    ids = table.column("episode_id").to_pylist()
    assert ids[0] == ids[1] != ids[2]
    assert table.column("episode_sample").to_pylist() == [0, 1, 1]
    assert table.column("episode_samples").to_pylist() == [2, 2, 2]


class LoopBoundEngine(ScriptedEngine):
    """An engine whose async machinery lives on one event loop (as SGLang's does): a call from any other loop
    would hang or fail there, so this one refuses it."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.event_loop = asyncio.new_event_loop()

    async def generate(self, prompt_ids, params):
        assert asyncio.get_running_loop() is self.event_loop, "called off the engine's own loop"
        return await super().generate(prompt_ids, params)


def test_an_engine_bound_to_its_loop_is_called_on_it_from_the_endpoints_thread(tok):
    cfg = RolloutConfig(prompt_length=512, response_length=512, n=1, seed=7,
                        multi_turn=MultiTurnConfig(max_assistant_turns=5),
                        agent=AgentConfig(entrypoint="tests.unit.endpoint.test_source:agent_ok"))
    engine = LoopBoundEngine(tok, SCRIPTS)
    source = AgentSource(cfg, engine, ChatTokenizer(tok), version=lambda: 0)
    try:
        batch = source.roll_out(ROWS, cfg)  # the rollout runs the engine's loop (driver.run_sync)
    finally:
        source.close()
        engine.event_loop.close()
    assert [m["state"] for m in batch["request_metrics"]] == ["completed", "completed"]
    assert engine.calls == 4


# ------------------------------------------------------------------------------------------ rounds (partial rollouts)
class _Version:
    """The trainer's weight version, as the source's sessions read it."""

    def __init__(self, value: int = 3):
        self.value = value

    def __call__(self) -> int:
        return self.value


def _source(tok: Any, engine: Any, version: _Version, timeout_s: float = 60.0) -> tuple[AgentSource, RolloutConfig]:
    cfg = RolloutConfig(prompt_length=512, response_length=512, n=2, seed=7,
                        multi_turn=MultiTurnConfig(max_assistant_turns=5),
                        agent=AgentConfig(entrypoint="tests.unit.endpoint.test_source:agent_ok", timeout_s=timeout_s))
    return AgentSource(cfg, engine, ChatTokenizer(tok), version=version, partial=True), cfg


def _rounds(source: AgentSource, version: _Version, budget: Budget, limit: int = 50) -> list[Any]:
    """Rounds under ``budget`` until every group is complete, the version one more each round; their reports."""
    reports = []
    while not all(g.complete for g in source.groups):
        assert len(reports) < limit, "the rounds do not end"
        reports.append(source.advance(version.value, budget))
        version.value += 1
    return reports


def _rows(source: AgentSource, cfg: RolloutConfig):
    groups = list(source.groups)
    source.remove(groups)
    return finish_batch([r for g in groups for r in g.requests()], cfg, source.chat)


def test_a_turn_budget_holds_each_program_between_rounds_and_the_rows_equal_an_unbudgeted_rollout(tok):
    want, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_ok")
    engine, version = ScriptedEngine(tok, SCRIPTS), _Version()
    source, cfg = _source(tok, engine, version)
    try:
        source.start(ROWS, cfg, born=0)
        first = source.advance(version.value, Budget(turns=1))
        assert (first.paused, first.resumed, engine.calls) == (4, 0, 4)  # one turn each, then held at the gate
        assert not any(g.complete for g in source.groups) and source.live_sessions == 4
        assert all(n > 0 for n in source.in_flight_lengths())
        version.value += 1
        second = source.advance(version.value, Budget(turns=1))
        assert (second.paused, second.resumed, engine.calls) == (0, 4, 8)
        batch = _rows(source, cfg)
    finally:
        source.close()
    for key in ("input_ids", "response_mask", "rollout_log_probs"):
        assert batch[key].tolist() == want[key].tolist(), key
    assert batch["source_reward"] == [1.0] * 4
    for row, mask in zip(batch["request_metrics"], batch["response_mask"]):
        assert row["state"] == "completed" and int(mask.sum()) > 0
    assert batch["oldest_version"] == [3] * 4  # the first turn sampled under version 3, the second under 4


def test_a_token_budget_cuts_turns_mid_generation_and_they_go_on_exactly(tok):
    want, _ = _roll(tok, "tests.unit.endpoint.test_source:agent_ok")
    engine, version = ScriptedEngine(tok, SCRIPTS), _Version()
    source, cfg = _source(tok, engine, version)
    try:
        source.start(ROWS, cfg, born=0)
        reports = _rounds(source, version, Budget(tokens=4))
        batch = _rows(source, cfg)
    finally:
        source.close()
    assert max(r.paused_mid_turn for r in reports) == 4 and len(reports) > 3
    for key in ("input_ids", "response_mask", "rollout_log_probs"):
        assert batch[key].tolist() == want[key].tolist(), key
    assert all(p == 0 for p in [m["sanity_check_mismatch"] for m in batch["request_metrics"]])
    assert engine.prompts[4][-4:] != engine.prompts[0][-4:]  # a later call fed the cut turn's first ids


def test_a_snapshot_taken_with_programs_held_resumes_to_the_same_rows(tok):
    version = _Version()
    source, cfg = _source(tok, ScriptedEngine(tok, SCRIPTS), version)
    try:
        source.start(ROWS, cfg, born=0)
        for _ in range(2):  # mid-turn: the first turn's first 8 tokens sampled
            source.advance(version.value, Budget(tokens=4))
            version.value += 1
        assert source.paused_mid_turn() == 4
        snap = pickle.loads(pickle.dumps(source.snapshot()))
        at = version.value
        _rounds(source, version, Budget(tokens=4))
        want = _rows(source, cfg)
    finally:
        source.close()
    engine, version = ScriptedEngine(tok, SCRIPTS), _Version(at)
    resumed, cfg = _source(tok, engine, version)
    try:
        resumed.restore(snap)
        assert engine.calls == 0 and resumed.paused_mid_turn() == 4  # replayed up to where each program stood
        _rounds(resumed, version, Budget(tokens=4))
        batch = _rows(resumed, cfg)
    finally:
        resumed.close()
    for key in ("input_ids", "response_mask", "rollout_log_probs", "uid"):
        got, exp = batch[key], want[key]
        assert (got.tolist() if hasattr(got, "tolist") else got) == (exp.tolist() if hasattr(exp, "tolist") else exp)
    assert batch["oldest_version"] == want["oldest_version"] == [3] * 4


def test_time_held_between_rounds_does_not_count_against_the_programs_timeout(tok):
    version = _Version()
    source, cfg = _source(tok, ScriptedEngine(tok, SCRIPTS), version, timeout_s=1.0)
    try:
        source.start(ROWS, cfg, born=0)
        source.advance(version.value, Budget(turns=1))
        time.sleep(1.5)  # "training": every program waits at its gate
        assert source.advance(version.value + 1, Budget(turns=1)).paused == 0
        batch = _rows(source, cfg)
    finally:
        source.close()
    assert [m["state"] for m in batch["request_metrics"]] == ["completed"] * 4


def test_closing_a_source_ends_the_programs_it_holds(tok):
    version = _Version()
    source, cfg = _source(tok, ScriptedEngine(tok, SCRIPTS), version)
    source.start(ROWS, cfg, born=0)
    source.advance(version.value, Budget(turns=1))
    episodes = [e for g in source.groups for e in g.sessions]
    source.close()
    assert not source.groups
    assert all(e.future.done() and e.done for e in episodes)
    assert all(e.req.state.value == "failed" for e in episodes)  # their held request got 409: the program failed


async def agent_answers_at_once(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Ends without a request: what makes slots change hands fastest."""
    return 1.0


async def agent_impatient(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Its client gives up on a request after 0.3 s: the second one, held for the next round."""
    from openai import AsyncOpenAI

    messages = list(row["prompt"])
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=0.3) as client:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for c in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": "5"})
        await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    return 1.0


def _agent_cfg(entrypoint: str, n: int = 2, **agent: Any) -> RolloutConfig:
    return RolloutConfig(prompt_length=512, response_length=512, n=n, seed=7,
                         multi_turn=MultiTurnConfig(max_assistant_turns=5),
                         agent=AgentConfig(entrypoint=f"tests.unit.endpoint.test_source:{entrypoint}", **agent))


def test_a_rollout_to_the_end_waits_for_every_program_however_slots_change_hands(tok):
    cfg = _agent_cfg("agent_answers_at_once", n=8, max_concurrent=2)
    source = AgentSource(cfg, ScriptedEngine(tok, SCRIPTS), ChatTokenizer(tok), version=lambda: 0)
    try:
        for _ in range(10):
            fresh = AgentSource(cfg, source.engine, source.chat, version=lambda: 0, host=source.host)
            requests, _ = roll_to_end(fresh, ROWS, cfg, weight_version=0)
            fresh.close()
            assert len(requests) == 16  # every episode ran, none cut off as a slot passed to the next
    finally:
        source.close()


def test_validation_runs_beside_programs_held_by_partial_rounds(tok):
    version = _Version()
    held, cfg = _source(tok, ScriptedEngine(tok, SCRIPTS), version)
    cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, max_concurrent=2))
    held = AgentSource(cfg, held.engine, held.chat, version=version, partial=True)
    try:
        held.start(ROWS, cfg, born=0)
        held.advance(version.value, Budget(turns=1))
        assert held.live_sessions == 4  # two hold their slots at the gate, two wait for one
        val_cfg = dataclasses.replace(cfg, n=1, temperature=0.0)
        val = AgentSource(val_cfg, held.engine, held.chat, version=version, host=held.host)
        requests, _ = roll_to_end(val, ROWS, val_cfg, weight_version=version.value)
        val.close()
        assert [r.state.value for r in requests] == ["completed", "completed"]
    finally:
        held.close()


def test_a_request_whose_client_gave_up_leaves_the_gate_and_samples_nothing(tok):
    version = _Version()
    cfg = _agent_cfg("agent_impatient", n=1)
    source = AgentSource(cfg, ScriptedEngine(tok, SCRIPTS), ChatTokenizer(tok), version=version, partial=True)
    try:
        source.start(ROWS[:1], cfg, born=0)
        source.advance(version.value, Budget(turns=1))
        episode = source.groups[0].sessions[0]
        deadline = time.monotonic() + 10
        while not episode.done and time.monotonic() < deadline:
            time.sleep(0.1)
        session = episode.session
        assert episode.done and session.gate.waiting == 0  # the abandoned request left within a poll
        assert [s.turns for s in session.samples] == [1]  # it never reached the engine
        assert episode.req.state.value == "failed"  # the program raised its client's timeout
    finally:
        source.close()
