"""A request that fails, or that the engine aborts, trains on nothing: real agent loop, real collate, real GRPO.

Each case breaks the conversation at its second of three assistant turns, after a real
tool call, so the row already holds sampled tokens when it ends.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from mcore_agentic.algorithms.sequence_advantages import compute_grpo_outcome_advantage
from mcore_agentic.interactions.base import BaseInteraction
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call

CFG = RolloutConfig(n=1, prompt_length=400, response_length=256, multi_turn=MultiTurnConfig(max_assistant_turns=3))
# Turn 1 asks the tool for 1234 + 4321; its result "5555" is in the prompt from turn 2 on.
SCRIPT = [call("add", a=1234, b=4321), call("add", a=1, b=1), "The answer is 5555."]


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def _row(question: str) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": question}],
        "data_source": "test/add",
        "reward_model": {"ground_truth": "5555"},
        "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"ground_truth": "5555"}}}},
    }


class AbortOnSecondTurn(ScriptedEngine):
    """Like the scripted engine, but the second turn of ``Q-abort`` is cut short with ``finish_reason='abort'``."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        out = await super().generate(prompt_ids, params)
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if "Q-abort" in text and "5555" in text:
            return GenerationOutput(out.token_ids[:3], out.log_probs[:3], "abort")
        return out


class RaisesOnSecondTurn(BaseInteraction):
    """A simulated user whose reply after the first tool-free turn raises (an environment bug)."""

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        raise ConnectionError("user simulator unreachable")


def _rollout(tokenizer, rows, engine, interactions=None):
    return asyncio.run(generate_sequences(rows, engine, {"add": AddTool()}, interactions, CFG, tokenizer))


def _mask_sums(batch) -> list[int]:
    return batch["response_mask"].sum(dim=1).tolist()


class FailsOnSecondTurn(ScriptedEngine):
    """Like the scripted engine, but raises on the second turn of ``Q-fail`` (an engine losing the request)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if "Q-fail" in text and "5555" in text:
            raise RuntimeError("engine lost the request at turn 2")
        return await super().generate(prompt_ids, params)


def test_a_request_failing_at_turn_two_trains_on_nothing(tokenizer):
    rows = [_row("Q-fail: add them"), _row("Q-fine: add them")]
    engine = FailsOnSecondTurn(tokenizer, {"Q-": SCRIPT})
    batch = _rollout(tokenizer, rows, engine)
    failed, fine = batch["request_metrics"]
    assert failed["state"] == "failed" and "turn 2" in failed["error"] and failed["assistant_turns"] == 1
    assert failed["response_tokens"] > 0  # it did sample a whole first turn
    assert _mask_sums(batch)[0] == 0 and _mask_sums(batch)[1] > 0
    assert batch.info["rollout/failed_requests"] == 1
    assert batch["finish_reason"] == ["aborted", "stop"]


def test_an_engine_abort_at_turn_two_trains_on_nothing(tokenizer):
    engine = AbortOnSecondTurn(tokenizer, {"Q-": SCRIPT})
    batch = _rollout(tokenizer, [_row("Q-abort: add them"), _row("Q-fine: add them")], engine)
    aborted, fine = batch["request_metrics"]
    assert aborted["state"] == "completed" and aborted["assistant_turns"] == 2
    assert batch["finish_reason"] == ["aborted", "stop"]
    assert _mask_sums(batch)[0] == 0 and _mask_sums(batch)[1] > 0
    assert batch.info["rollout/aborted_requests"] == 1


def test_an_environment_error_mid_conversation_trains_on_nothing(tokenizer):
    engine = ScriptedEngine(tokenizer, {"Q-": ["I think it is 7.", "More?"]})
    row = _row("Q-user: add them")
    row["extra_info"]["interaction_kwargs"] = {"name": "user"}
    batch = _rollout(tokenizer, [row], engine, interactions={"user": RaisesOnSecondTurn({"name": "user"})})
    (metrics,) = batch["request_metrics"]
    assert metrics["state"] == "failed" and "user simulator unreachable" in metrics["error"]
    assert metrics["response_tokens"] > 0 and _mask_sums(batch) == [0]


def test_failed_rows_do_not_move_their_group_baseline():
    """GRPO over [fine 1.0, fine 0.0, failed 0.0] equals GRPO over the two fine rows alone."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    rewards = torch.zeros(3, 3)
    rewards[0, 1] = 1.0
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, ["u", "u", "u"])
    alone, _ = compute_grpo_outcome_advantage(rewards[:2], mask[:2], ["u", "u"])
    torch.testing.assert_close(adv[:2], alone)
    assert adv[2].abs().sum() == 0
