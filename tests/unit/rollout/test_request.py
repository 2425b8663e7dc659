"""The request state machine and the typed trajectory."""

from __future__ import annotations

import pytest

from mcore_agentic.rollout.request import (
    FinishReason,
    IllegalTransition,
    RequestState,
    RolloutRequest,
    Trajectory,
)


def _req() -> RolloutRequest:
    return RolloutRequest(request_id="r", uid="u", messages=[{"role": "user", "content": "hi"}])


def test_happy_path_through_tools_and_interaction():
    r = _req()
    assert r.state is RequestState.PENDING and not r.done
    for state in (
        RequestState.RUNNING,
        RequestState.TOOL_CALLING,
        RequestState.RUNNING,
        RequestState.INTERACTING,
        RequestState.RUNNING,
    ):
        r.transition(state)
    r.complete(FinishReason.STOP)
    assert r.done and r.state is RequestState.COMPLETED and r.finish_reason is FinishReason.STOP
    assert r.metrics.latency_seconds >= 0


@pytest.mark.parametrize(
    "path",
    [
        [RequestState.TOOL_CALLING],  # pending -> tool_calling
        [RequestState.COMPLETED],  # pending -> completed (never ran)
        [RequestState.RUNNING, RequestState.PENDING],
        [RequestState.RUNNING, RequestState.TOOL_CALLING, RequestState.INTERACTING],
    ],
)
def test_illegal_transitions_raise(path):
    r = _req()
    with pytest.raises(IllegalTransition):
        for state in path:
            r.transition(state)


def test_terminal_states_are_final():
    r = _req()
    r.transition(RequestState.RUNNING)
    r.fail("boom")
    assert r.state is RequestState.FAILED and r.finish_reason is FinishReason.ABORTED and r.error == "boom"
    with pytest.raises(IllegalTransition):
        r.transition(RequestState.RUNNING)
    with pytest.raises(IllegalTransition):
        r.fail("again")
    done = _req()
    done.transition(RequestState.RUNNING)
    done.complete(FinishReason.LENGTH)
    with pytest.raises(IllegalTransition):
        done.complete(FinishReason.STOP)


def test_pending_request_can_fail():
    r = _req()
    r.fail("bad data")
    assert r.state is RequestState.FAILED


def test_trajectory_keeps_lists_in_step():
    t = Trajectory()
    t.set_prompt([1, 2, 3])
    t.append([4, 5], sampled=True, log_probs=[-0.1, -0.2])
    t.append([6], sampled=False)
    t.append([7, 8], sampled=True, log_probs=[-0.3, -0.4])
    assert t.ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 1, 1]
    assert t.log_probs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, -0.3, -0.4]
    assert t.prompt_ids == [1, 2, 3] and t.response_ids == [4, 5, 6, 7, 8]
    assert t.response_mask == [1, 1, 0, 1, 1] and t.response_len == 5
    assert t.position_ids == list(range(8)) and t.attention_mask == [1] * 8
    t.truncate(6)
    assert (t.ids, t.loss_mask, t.log_probs) == ([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 0], [0.0, 0.0, 0.0, -0.1, -0.2, 0.0])
    assert len(t.position_ids) == 6
    with pytest.raises(ValueError, match="prompt"):
        t.truncate(2)


def test_trajectory_rejects_inconsistent_segments():
    t = Trajectory()
    t.set_prompt([1])
    with pytest.raises(ValueError, match="log_probs"):
        t.append([2, 3], sampled=True, log_probs=[-1.0])
    with pytest.raises(ValueError, match="log_probs"):
        t.append([2], sampled=True)
    with pytest.raises(ValueError, match="environment"):
        t.append([2], sampled=False, log_probs=[0.0])
    with pytest.raises(IllegalTransition):
        t.set_prompt([9])
    assert t.ids == [1]


def test_tool_reward_total():
    r = _req()
    r.tool_rewards = {"a": 0.5, "b": 1.0}
    assert r.total_tool_reward == 1.5
