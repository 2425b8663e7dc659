"""Tokenization through the real agent loop: the sampled text is what is rendered back, the CPU work
runs off the event loop, and the loop's stalls are measured."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.agent_loop import assistant_message
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from mcore_agentic.rollout.tool_parser import get_tool_parser
from mcore_agentic.tools.base import BaseTool, ToolResponse
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def _rollout(tokenizer, scripts: dict[str, list[str]], tools: dict[str, Any], **mt: Any):
    rows = [{"prompt": [{"role": "user", "content": f"{key} question"}]} for key in scripts]
    cfg = RolloutConfig(prompt_length=512, response_length=1024, multi_turn=MultiTurnConfig(**mt))
    return asyncio.run(generate_sequences(rows, ScriptedEngine(tokenizer, scripts), tools, None, cfg, tokenizer))


@pytest.mark.parametrize("threads", [0, 2])
def test_sampled_whitespace_is_rendered_back_and_the_strict_check_passes(tokenizer, threads):
    """"Reasoning. " before a call: the message keeps the space, every turn takes one render, no mismatch."""
    turns = [f"Step {t}: adding. \n" + call("add", a=t, b=1) for t in range(6)] + ["Done. "]
    batch = _rollout(tokenizer, {"Q-ws": turns}, {"add": AddTool()}, max_assistant_turns=8, tokenizer_threads=threads)
    m = batch.meta["request_metrics"][0]
    assert m["state"] == "completed" and m["tool_calls"] == 6, m
    assert m["template_drift"] == 0 and m["template_fallback"] == 0 and m["tokenization_full_context"] == 0
    assert batch.info["rollout/sanity_check_mismatches"] == 0
    assistants = [msg for msg in batch.meta["messages"][0] if msg["role"] == "assistant"]
    assert [msg["content"] for msg in assistants[:2]] == ["Step 0: adding. ", "Step 1: adding. "]


def test_unrenderable_text_is_counted_as_drift_and_reported(tokenizer):
    """No newline before the call: the template cannot write that back; the strict check says so, once per turn."""
    turns = [f"Step {t}." + call("add", a=t, b=1) for t in range(3)] + ["Done."]
    batch = _rollout(tokenizer, {"Q-drift": turns}, {"add": AddTool()}, max_assistant_turns=5)
    m = batch.meta["request_metrics"][0]
    assert m["template_drift"] == 3 and m["sanity_check_mismatch"] == 1
    loose = _rollout(
        tokenizer, {"Q-drift": turns}, {"add": AddTool()}, max_assistant_turns=5, tokenization_sanity_check_mode="ignore_strippable"
    )
    assert loose.info["rollout/sanity_check_mismatches"] == 0  # '.\n<tool_call>' -> '.<tool_call>' is whitespace only


def test_threads_and_event_loop_give_the_same_trajectories(tokenizer):
    scripts = {f"Q-{i}": [call("add", a=i, b=k) for k in range(3)] + ["ok"] for i in range(6)}
    a = _rollout(tokenizer, scripts, {"add": AddTool()}, tokenizer_threads=0)
    b = _rollout(tokenizer, scripts, {"add": AddTool()}, tokenizer_threads=3)
    for key in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(a.tensors[key], b.tensors[key]), key


class _BlockingTool(BaseTool):
    """Blocks the event loop (``time.sleep`` inside ``async execute``): the stall the monitor must see. It declares
    itself loop-safe (wrongly), so it runs on the loop; an undeclared one would run on a worker thread."""

    runs_on_event_loop = True

    def __init__(self) -> None:
        schema = {"type": "function", "function": {"name": "block", "parameters": {"type": "object", "properties": {}}}}
        super().__init__({}, schema)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        time.sleep(0.3)
        return ToolResponse(text="done")


def test_event_loop_stall_is_measured(tokenizer):
    quick = _rollout(tokenizer, {"Q-quick": [call("add", a=1, b=2), "ok"]}, {"add": AddTool()})
    assert 0.0 <= quick.info["rollout/event_loop_max_stall_s"] < 0.25
    blocked = _rollout(tokenizer, {"Q-block": [call("block"), "ok"]}, {"block": _BlockingTool()})
    assert blocked.info["rollout/event_loop_max_stall_s"] >= 0.25


def test_assistant_message_keeps_the_sampled_content():
    parser = get_tool_parser("hermes")
    body = call("add", a=1, b=2)
    for text, content in [
        ("Reasoning. \n" + body, "Reasoning. "),  # the template writes "\n" between content and calls
        ("Reasoning.\n\n" + body + "\n", "Reasoning.\n"),  # trailing whitespace after the calls is not content
        (body, ""),
        ("  spaced  ", "  spaced  "),  # no calls: exactly as sampled
    ]:
        parsed_content, calls = parser.parse(text)
        message = assistant_message(text, parsed_content, calls)
        assert message["content"] == content, text
    # text after the calls cannot be rendered in place: the parser's content (all the text) is kept
    text = "Before.\n" + body + "\nAfter."
    parsed_content, calls = parser.parse(text)
    assert assistant_message(text, parsed_content, calls)["content"] == parsed_content == "Before.\nAfter."
    # a malformed call stays in the content, as written
    text = "Try: <tool_call>{bad json</tool_call>"
    parsed_content, calls = parser.parse(text)
    message = assistant_message(text, parsed_content, calls)
    assert message["content"] == text and "tool_calls" not in message


def test_batch_repr_shows_shapes_not_values():
    batch = Batch(tensors={"input_ids": torch.arange(10**6).view(1000, 1000)}, meta={"uid": ["u"] * 1000})
    assert repr(batch) == "Batch(len=1000, tensors[input_ids=(1000, 1000)], meta=['uid'], info=[])"
