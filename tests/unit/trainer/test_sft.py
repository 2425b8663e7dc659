"""SFT demonstrations are tokenized exactly as the rollout would produce them (same ids, same loss mask)."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.data.config import SyntheticTaskConfig
from mcore_agentic.data.synthetic import ideal_conversation, make_rows
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences_sync
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.tools.registry import load_tools
from mcore_agentic.trainer.sft import collate_trajectories, tokenize_demo
from tests.unit.rollout.scripted import ScriptedEngine

CALCULATOR = "configs/tools/calculator_tool_config.yaml"


@pytest.fixture(scope="module")
def tok():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def test_demo_equals_the_rollout_of_its_ideal_answers(tok):
    chat = ChatTokenizer(tok)
    tools = load_tools(CALCULATOR)
    schemas = [t.get_openai_tool_schema() for t in tools.values()]
    rows, _ = make_rows(SyntheticTaskConfig(enable=True, num_train=3, num_val=0))
    demos = [ideal_conversation(r) for r in rows]
    trajs = [tokenize_demo(d, chat, schemas) for d in demos]
    # The engine answers each turn with the template's own rendering of the ideal assistant message.
    scripts = {}
    for row, demo in zip(rows, demos):
        replies = [m for m in demo if m["role"] == "assistant"]
        texts = [tok.decode(chat.assistant_turn_ids(m, tools=schemas)[:-1], skip_special_tokens=False) for m in replies]
        scripts[row["prompt"][-1]["content"]] = texts
    cfg = RolloutConfig(n=1, prompt_length=512, response_length=128,
                        multi_turn=MultiTurnConfig(max_assistant_turns=3, format="hermes"))
    batch = generate_sequences_sync(rows, ScriptedEngine(tok, scripts), tools, {}, cfg, chat)
    assert batch.info["rollout/sanity_check_mismatches"] == 0
    assert all(m["tool_calls"] == 1 and m["tool_errors"] == 0 for m in batch["request_metrics"])
    sft = collate_trajectories(trajs, tok.pad_token_id)
    for key in ("prompts", "responses", "response_mask", "attention_mask", "input_ids"):
        assert torch.equal(sft[key], batch[key]), key
    # Loss mask: the two assistant turns only (tool call and answer, each with its <|im_end|>).
    prompt_ids, ids, mask = trajs[0]
    sampled = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert sampled.count("<|im_end|>") == 2 and "<tool_call>" in sampled and "####" in sampled
    assert "<tool_response>" not in sampled and "<|im_start|>" not in sampled
