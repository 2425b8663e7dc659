"""GSM8KTool: per-instance ground truth, feedback text, step reward, final reward on the latest answer."""

import asyncio
from decimal import Decimal

import pytest

from mcore_agentic.tools.gsm8k import GSM8KTool, extract_answer

SCHEMA = {"type": "function", "function": {"name": "calc_gsm8k_reward"}}


@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("so #### 72", "strict", Decimal(72)),
        ("#### 5 then #### 1,234.50", "strict", Decimal("1234.50")),
        ("the answer is 72", "strict", None),
        ("the answer is $1,000.", "flexible", Decimal(1000)),
        ("-3 apples", "flexible", Decimal(-3)),
        ("no digits", "flexible", None),
        (None, "flexible", None),
    ],
)
def test_extract_answer(text, method, expected):
    assert extract_answer(text, method) == expected


def test_scoring_flow_with_penalty():
    async def main():
        tool = GSM8KTool({"no_improvement_penalty": 0.05}, SCHEMA)
        a = await tool.create("a", ground_truth="Natalia sold 48/2 = 24 clips.\n#### 72")
        b = await tool.create("b", ground_truth=10)
        wrong = await tool.execute(a, {"answer": "70"})
        right = await tool.execute(a, {"answer": "72.0"})
        again = await tool.execute(a, {"answer": "#### 72"})
        other = await tool.execute(b, {"answer": 10})  # a bare number is tolerated
        rewards = await tool.calc_reward(a), await tool.calc_reward(b)
        await tool.execute(a, {"answer": "71"})  # the latest answer is what counts
        after = await tool.calc_reward(a)
        await tool.release(a)
        return wrong, right, again, other, rewards, after, await tool.calc_reward(a)

    wrong, right, again, other, rewards, after, released = asyncio.run(main())
    assert wrong.text == "Current parsed answer=70 reward=0.0" and wrong.reward == -0.05
    assert right.text == "Current parsed answer=72 reward=1.0" and right.reward == 0.0
    assert again.reward == -0.05  # no improvement over the best so far
    assert other.metrics == {"correct": 1.0}
    assert rewards == (1.0, 1.0) and after == 0.0 and released == 0.0


def test_bad_parameters_are_error_observations():
    async def main():
        tool = GSM8KTool({}, SCHEMA)
        iid = await tool.create(ground_truth="3")
        return (
            await tool.execute(iid, {}),
            await tool.execute(iid, {"answer": ["3"]}),
            await tool.execute("never-created", {"answer": "3"}),
            await tool.execute(iid, {"answer": "three"}),
        )

    missing, wrong_type, unknown, no_number = asyncio.run(main())
    assert missing.is_error and "string argument 'answer'" in missing.text
    assert wrong_type.is_error
    assert unknown.is_error and "no open instance" in unknown.text
    assert not no_number.is_error and "no number found" in no_number.text and no_number.metrics["correct"] == 0.0


def test_exported_state_restores_an_instance_in_a_fresh_tool():
    """A paused request's tool instance survives a checkpoint: re-created by id, its answers come back."""
    async def main():
        tool = GSM8KTool({"no_improvement_penalty": 0.05}, SCHEMA)
        a = await tool.create("a", ground_truth="#### 72")
        await tool.execute(a, {"answer": "72"})
        state = tool.export_state(a)
        fresh = GSM8KTool({"no_improvement_penalty": 0.05}, SCHEMA)
        await fresh.create("a", ground_truth="#### 72")
        before = await fresh.calc_reward("a")
        fresh.import_state("a", state)
        again = await fresh.execute("a", {"answer": "#### 72"})  # no improvement on the restored best: penalised
        return before, await fresh.calc_reward("a"), again.reward

    before, after, step_reward = asyncio.run(main())
    assert before == 0.0 and after == 1.0 and step_reward == -0.05
