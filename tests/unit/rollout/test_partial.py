"""Partial rollouts: a request paused at a turn budget resumes where it stopped (each segment keeping its
weight version), through a pickled checkpoint too, with its tool's state; the buffer hands out the oldest
complete groups and releases what it still holds at the end."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences, rollout_context
from mcore_agentic.rollout.partial import RolloutBuffer
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call

# Q-long: three tool calls then the answer (4 turns); Q-short: the answer at once.
SCRIPTS = {
    "Q-long": [call("add", a=1, b=2), call("add", a=3, b=4), call("add", a=5, b=0), "#### 5"],
    "Q-short": ["#### 7"],
}


class StatefulAdd(AddTool):
    """AddTool whose per-instance results travel through checkpoints (what a stateful tool must declare)."""

    instance_state_attrs = ("results",)


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def _cfg(n: int = 2) -> RolloutConfig:
    return RolloutConfig(n=n, seed=11, prompt_length=400, response_length=300,
                         multi_turn=MultiTurnConfig(max_assistant_turns=6))


def _rows(*questions: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{q}: add?"}], "data_source": "t",
             "reward_model": {"ground_truth": "5"},
             "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"ground_truth": "5"}}}}} for q in questions]


def _ctx(engine, tokenizer, tool, version: int, budget: int | None = 1):
    return rollout_context(engine, {"add": tool}, None, _cfg(), tokenizer, weight_version=version, turn_budget=budget)


def test_paused_requests_resume_to_the_uninterrupted_trajectory(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    whole = asyncio.run(generate_sequences(_rows("Q-long", "Q-short"), engine, {"add": AddTool()}, None, _cfg(), tokenizer))

    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def rounds():
        buf.add(_rows("Q-long", "Q-short"), _cfg(), _ctx(engine, tokenizer, tool, 0), step=1)
        reports = []
        for version in range(4):
            reports.append(await buf.run(_ctx(engine, tokenizer, tool, version)))
        return reports

    reports = asyncio.run(rounds())
    # Round 0: the long requests pause after one turn, the short ones end; then one turn per round.
    assert [(r.resumed, r.paused) for r in reports] == [(0, 2), (2, 2), (2, 2), (2, 0)]
    assert buf.complete_groups == 2 and buf.live_sessions == 0
    requests = buf.take(2)
    assert len(buf) == 0
    for got, i in zip(requests, range(4)):
        traj = got.trajectory
        assert traj.response_ids == whole["responses"][i][whole["attention_mask"][i, whole["prompts"].shape[1]:].bool()].tolist()
        sampled = [v for v, m in zip(traj.response_versions, traj.response_mask) if m]
        assert all(v == -1 for v, m in zip(traj.response_versions, traj.response_mask) if not m)
        if got.messages[0]["content"].startswith("Q-long"):
            assert sorted(set(sampled)) == [0, 1, 2, 3]  # one turn per weight version
            assert got.metrics.tool_calls == 3 and got.total_tool_reward == pytest.approx(1.3)
        else:
            assert set(sampled) == {0}
    # Every tool instance was released once its request ended, none before.
    assert sorted(AddTool.released[-2:]) == sorted(r.request_id for r in requests if "Q-long" in r.messages[0]["content"])


def test_snapshot_restores_paused_sessions_with_their_tool_state(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def first():
        buf.add(_rows("Q-long", "Q-short"), _cfg(), _ctx(engine, tokenizer, tool, 0), step=3)
        await buf.run(_ctx(engine, tokenizer, tool, 0))
        await buf.run(_ctx(engine, tokenizer, tool, 1))

    asyncio.run(first())
    blob = pickle.dumps(buf.snapshot())
    paused_ids = [s.req.request_id for g in buf.groups for s in g.sessions if s.paused]
    assert len(paused_ids) == 2 and all(tool.results[i] == [3, 7] for i in paused_ids)

    # A fresh process: new tool objects, the buffer from the checkpoint.
    fresh = StatefulAdd()
    restored = asyncio.run(RolloutBuffer.restore(pickle.loads(blob), _ctx(engine, tokenizer, fresh, 0)))
    assert [g.born for g in restored.groups] == [3, 3] and restored.live_sessions == 2
    assert all(fresh.results[i] == [3, 7] for i in paused_ids)  # the tool's state came back

    async def rest(b, t):
        for version in (2, 3):
            await b.run(_ctx(engine, tokenizer, t, version))
        return b.take(2)

    original = asyncio.run(rest(buf, tool))
    again = asyncio.run(rest(restored, fresh))
    for x, y in zip(original, again):
        assert x.request_id == y.request_id
        assert x.trajectory.ids == y.trajectory.ids and x.trajectory.loss_mask == y.trajectory.loss_mask
        assert x.trajectory.log_probs == y.trajectory.log_probs and x.trajectory.versions == y.trajectory.versions
        assert _no_call_ids(x.messages) == _no_call_ids(y.messages) and x.tool_rewards == y.tool_rewards


def _no_call_ids(messages: list[dict]) -> list[dict]:
    """Messages without tool-call ids (random per process, never part of the Qwen render)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if "tool_calls" in m:
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        out.append(m)
    return out


def test_take_hands_out_the_oldest_complete_groups_and_close_releases_the_rest(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def go():
        buf.add(_rows("Q-long"), _cfg(), _ctx(engine, tokenizer, tool, 0), step=1)
        buf.add(_rows("Q-short"), _cfg(), _ctx(engine, tokenizer, tool, 0), step=2)
        buf.add(_rows("Q-short"), _cfg(), _ctx(engine, tokenizer, tool, 0), step=3)
        await buf.run(_ctx(engine, tokenizer, tool, 0))

    asyncio.run(go())
    assert buf.complete_groups == 2 and buf.oldest_born() == 1
    step2_uid = buf.groups[1].uid
    taken = buf.take(1)  # the long step-1 group is not complete: the step-2 group is the oldest complete one
    assert [r.uid for r in taken] == [step2_uid, step2_uid]
    assert len(buf) == 2 and buf.groups[0].born == 1 and buf.groups[1].born == 3  # the step-2 group trained
    with pytest.raises(ValueError, match="2 complete groups wanted, 1"):
        buf.take(2)
    live = [s.req.request_id for g in buf.groups for s in g.sessions if s.paused]
    assert live and all(i in tool._instances for i in live)
    asyncio.run(buf.close())
    assert len(buf) == 0 and not any(i in tool._instances for i in live)


# -- the token budget: pauses inside an assistant turn ------------------------------------------------------------


def _token_ctx(engine, tokenizer, tool, version: int, tokens: int | None = 5, turns: int | None = None):
    return rollout_context(engine, {"add": tool}, None, _cfg(), tokenizer, weight_version=version, turn_budget=turns,
                           token_budget=tokens)


def _same_trajectory(got, whole, i: int) -> None:
    traj = got.trajectory
    row_mask = whole["attention_mask"][i, whole["prompts"].shape[1]:].bool()
    assert traj.response_ids == whole["responses"][i][row_mask].tolist()
    assert traj.response_mask == whole["response_mask"][i][row_mask].tolist()
    lps = whole["rollout_log_probs"][i][row_mask].tolist()
    assert traj.response_log_probs == pytest.approx(lps)


@pytest.mark.parametrize("tokens", [1, 5, 13])
def test_token_budget_cuts_turns_and_resumes_to_the_uninterrupted_trajectory(tokenizer, tokens):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    whole = asyncio.run(generate_sequences(_rows("Q-long", "Q-short"), engine, {"add": AddTool()}, None, _cfg(), tokenizer))
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def rounds():
        buf.add(_rows("Q-long", "Q-short"), _cfg(), _token_ctx(engine, tokenizer, tool, 0, tokens), step=1)
        reports, version = [], 0
        while buf.live_sessions:
            reports.append(await buf.run(_token_ctx(engine, tokenizer, tool, version, tokens)))
            version += 1
        return reports

    reports = asyncio.run(rounds())
    assert any(r.paused_mid_turn for r in reports)
    requests = buf.take(2)
    for i, got in enumerate(requests):
        _same_trajectory(got, whole, i)
        traj = got.trajectory
        sampled = [v for v, m in zip(traj.response_versions, traj.response_mask) if m]
        # each round samples at most `tokens` tokens per request, in order, under that round's version
        assert sampled == sorted(sampled)
        assert all(sampled.count(v) <= tokens for v in set(sampled))
        assert got.metrics.assistant_turns == (4 if "Q-long" in got.messages[0]["content"] else 1)
        assert len(got.turn_ends) == got.metrics.assistant_turns
        if "Q-long" in got.messages[0]["content"]:
            assert got.metrics.mid_turn_pauses > 0 and got.total_tool_reward == pytest.approx(1.3)
        assert got.metrics.sanity_check_mismatch == 0
    # the routed turns keep the messages the uncut run produced
    assert requests[0].messages[-1]["content"] == "#### 5"


def test_token_budget_with_a_turn_budget_pauses_at_whichever_comes_first(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def go():
        buf.add(_rows("Q-long"), _cfg(), _token_ctx(engine, tokenizer, tool, 0), step=1)
        return [await buf.run(_token_ctx(engine, tokenizer, tool, v, tokens=1000, turns=2)) for v in range(2)]

    reports = asyncio.run(go())
    assert [(r.paused, r.paused_mid_turn) for r in reports] == [(2, 0), (0, 0)]  # turns pause, at boundaries


def test_a_session_paused_mid_turn_survives_a_checkpoint(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def first():
        buf.add(_rows("Q-long"), _cfg(), _token_ctx(engine, tokenizer, tool, 0), step=1)
        for v in range(3):
            await buf.run(_token_ctx(engine, tokenizer, tool, v))

    asyncio.run(first())
    assert all(s.open_turn > 0 for g in buf.groups for s in g.sessions)  # 15 tokens in: inside turn 2
    restored = asyncio.run(RolloutBuffer.restore(pickle.loads(pickle.dumps(buf.snapshot())),
                                                 _token_ctx(engine, tokenizer, StatefulAdd(), 0)))
    assert [s.open_turn for g in restored.groups for s in g.sessions] == [s.open_turn for g in buf.groups for s in g.sessions]

    async def rest(b, t):
        v = 3
        while b.live_sessions:
            await b.run(_token_ctx(engine, tokenizer, t, v))
            v += 1
        return b.take(1)

    for x, y in zip(asyncio.run(rest(buf, tool)), asyncio.run(rest(restored, StatefulAdd()))):
        assert x.trajectory.ids == y.trajectory.ids and x.trajectory.versions == y.trajectory.versions
        assert x.trajectory.log_probs == y.trajectory.log_probs and x.turn_ends == y.turn_ends


def test_a_request_at_the_staleness_bound_runs_free_of_the_budgets(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def go():
        buf.add(_rows("Q-long"), _cfg(), _token_ctx(engine, tokenizer, tool, 0), step=1)
        return [await buf.run(_token_ctx(engine, tokenizer, tool, v), max_staleness=2) for v in range(3)]

    reports = asyncio.run(go())
    # rounds 0 and 1 cut the requests; at version 2 their first tokens (version 0) are 2 versions old: they finish
    assert [(r.paused, r.prioritised) for r in reports] == [(2, 0), (2, 0), (0, 2)]
    for req in buf.take(1):
        assert req.messages[-1]["content"] == "#### 5"
        assert max(req.trajectory.response_versions) == 2


def test_routing_replay_records_each_segment_of_a_cut_turn(tokenizer):
    """Each segment's engine call records the rows of the tokens it fed (first call wins): every token but the
    last sampled one gets its own row, segments included (the cut turn's last id is fed by the next call)."""
    engine = ScriptedEngine(tokenizer, SCRIPTS, routing=True)
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def go():
        buf.add(_rows("Q-long"), _cfg(), _token_ctx(engine, tokenizer, tool, 0, tokens=7), step=1)
        v = 0
        while buf.live_sessions:
            await buf.run(_token_ctx(engine, tokenizer, tool, v, tokens=7))
            v += 1

    asyncio.run(go())
    for req in buf.take(1):
        traj = req.trajectory
        routed = traj.routed_experts
        assert req.metrics.mid_turn_pauses > 0
        fed = routed[:-1]
        assert (fed[:, 0, 0] == [t % 30000 for t in traj.ids[:-1]]).all()
        assert (fed[:, 0, 1] == range(len(traj.ids) - 1)).all()  # each row is its own token's, at its position
        assert (routed[-1] == -1).all()
        calls = fed[:, 1, 1]
        assert (calls[1:] >= calls[:-1]).all()


class LengthFirstEngine(ScriptedEngine):
    """Reports "length" whenever it returns max_new_tokens ids, a stop token last included (SGLang checks the
    length before the stop tokens)."""

    async def generate(self, prompt_ids, params):
        out = await super().generate(prompt_ids, params)
        if len(out.token_ids) >= params.max_new_tokens:
            out = dataclasses.replace(out, finish_reason="length")
        return out


def test_a_stop_token_sampled_as_the_budgets_last_token_ends_the_turn_not_the_request(tokenizer):
    engine = LengthFirstEngine(tokenizer, SCRIPTS)
    first_turn = len(tokenizer.encode(call("add", a=1, b=2), add_special_tokens=False)) + 1  # with <|im_end|>
    tool = StatefulAdd()
    buf = RolloutBuffer()

    async def go():
        buf.add(_rows("Q-long"), _cfg(), _token_ctx(engine, tokenizer, tool, 0, tokens=first_turn), step=1)
        v = 0
        while buf.live_sessions:
            await buf.run(_token_ctx(engine, tokenizer, tool, v, tokens=first_turn))
            v += 1

    asyncio.run(go())
    for req in buf.take(1):
        assert req.finish_reason.value == "stop" and req.messages[-1]["content"] == "#### 5"
        assert req.metrics.tool_calls == 3
