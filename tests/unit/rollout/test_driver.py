"""The batch driver: n samples per prompt, collation layout, failures, sync use."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences, generate_sequences_sync
from mcore_agentic.utils.errors import ConfigError
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call


def _rows():
    return [
        {
            "prompt": [{"role": "user", "content": "Q-a: 2+3?"}],
            "data_source": "test/add",
            "reward_model": {"ground_truth": "5"},
            "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"ground_truth": "5"}}}},
        },
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q-b: say hi"}],
            "data_source": "test/chat",
            "reward_model": {"ground_truth": "hi"},
        },
    ]


SCRIPTS = {"Q-a": [call("add", a=2, b=3), "It is 5."], "Q-b": ["hi"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def test_collated_batch_layout(tokenizer):
    cfg = RolloutConfig(n=3, prompt_length=400, response_length=64, multi_turn=MultiTurnConfig(max_assistant_turns=3))
    add = AddTool()
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    batch = asyncio.run(generate_sequences(_rows(), engine, {"add": add}, None, cfg, tokenizer))
    assert len(batch) == 6
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    assert p <= 400 and r <= 64
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch[key].shape == (6, p + r)
    for key in ("response_mask", "rollout_log_probs"):
        assert batch[key].shape == (6, r)
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], 1))
    assert batch["uid"][0] == batch["uid"][1] == batch["uid"][2] != batch["uid"][3]
    assert batch["ground_truth"] == ["5"] * 3 + ["hi"] * 3
    assert batch["data_source"][3] == "test/chat"
    assert batch["finish_reason"] == ["stop"] * 6
    assert batch["num_turns"] == [2, 2, 2, 1, 1, 1]
    assert batch["tool_rewards"][:3] == [pytest.approx(1.1)] * 3 and batch["tool_rewards"][3:] == [0.0] * 3
    assert add.executions == 3
    pad = tokenizer.pad_token_id
    for i in range(6):
        attn = batch["attention_mask"][i]
        prompt_real = attn[:p]
        # prompts left-padded, responses right-padded
        assert torch.all(prompt_real[:-1] <= prompt_real[1:]) and prompt_real[-1] == 1
        resp_real = attn[p:]
        assert torch.all(resp_real[:-1] >= resp_real[1:])
        assert torch.equal(batch["position_ids"][i][attn.bool()], torch.arange(int(attn.sum())))
        mask = batch["response_mask"][i]
        assert torch.all(mask <= resp_real)  # loss only on real tokens
        assert torch.all(batch["rollout_log_probs"][i][mask == 0] == 0)
        assert torch.all(batch["rollout_log_probs"][i][mask == 1] < 0)
        assert torch.all(batch["input_ids"][i][~attn.bool()] == pad)
        metrics = batch["request_metrics"][i]
        assert metrics["state"] == "completed" and metrics["sanity_check_mismatch"] == 0
    # tool-result tokens are masked out: decode the mask-0 real response tokens of a tool sample
    env = batch["responses"][0][(batch["response_mask"][0] == 0) & batch["attention_mask"][0][p:].bool()]
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(env)
    assert batch.info["rollout/failed_requests"] == 0


def test_failed_request_becomes_an_empty_row(tokenizer):
    cfg = RolloutConfig(n=2, prompt_length=400, response_length=64)
    engine = ScriptedEngine(tokenizer, SCRIPTS, fail_on="Q-b")
    batch = generate_sequences_sync(_rows(), engine, {"add": AddTool()}, None, cfg, tokenizer)
    assert batch["finish_reason"][2:] == ["aborted", "aborted"]
    assert [m["state"] for m in batch["request_metrics"]] == ["completed"] * 2 + ["failed"] * 2
    assert "scripted engine failure" in batch["request_metrics"][2]["error"]
    assert int(batch["response_mask"][2:].sum()) == 0
    assert batch.info["rollout/failed_requests"] == 2


def test_sync_wrapper_inside_running_loop(tokenizer):
    cfg = RolloutConfig(prompt_length=400, response_length=64)
    engine = ScriptedEngine(tokenizer, SCRIPTS)

    async def inside():
        return generate_sequences_sync(_rows()[1:], engine, None, None, cfg, tokenizer)

    assert len(asyncio.run(inside())) == 1


def test_sync_wrapper_runs_on_the_engines_own_loop(tokenizer):
    """An engine bound to a loop (``engine.event_loop``) gets the rollout on it, keyword arguments or not."""
    loops = []

    class BoundEngine(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            loops.append(asyncio.get_running_loop())
            return await super().generate(prompt_ids, params)

    engine = BoundEngine(tokenizer, SCRIPTS)
    engine.event_loop = asyncio.new_event_loop()
    try:
        cfg = RolloutConfig(prompt_length=400, response_length=64)
        batch = generate_sequences_sync(
            rows=_rows()[1:], engine=engine, tools=None, interactions=None, cfg=cfg, tokenizer=tokenizer
        )
        assert len(batch) == 1 and loops and all(loop is engine.event_loop for loop in loops)
    finally:
        engine.event_loop.close()


def test_bad_rows_name_the_field(tokenizer):
    cfg = RolloutConfig()
    with pytest.raises(ConfigError, match=r"prompts\[0\]\.prompt"):
        asyncio.run(generate_sequences([{"prompt": "hello"}], None, None, None, cfg, tokenizer))


def test_build_tools_and_engine(tmp_path):
    from pathlib import Path

    from mcore_agentic.feed.build import build_tools
    from mcore_agentic.rollout.engines import build_engine
    from mcore_agentic.rollout.engines.hf import HFEngine

    root = Path(__file__).resolve().parents[3]
    mt = MultiTurnConfig(enable=True, tool_config_path=str(root / "configs/tools/calculator_tool_config.yaml"))
    tools, interactions, executor = build_tools(RolloutConfig(multi_turn=mt))
    try:
        assert set(tools) == {"calculator"} and interactions == {}
        assert tools["calculator"].executor is executor
    finally:
        executor.shutdown()
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.models.tiny import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / "m", vocab_size=256, hidden_size=32, intermediate_size=64)
    spec = ModelSpec(path, "float32")
    assert isinstance(build_engine(RolloutConfig(name="hf"), spec, device="cpu", seed=0), HFEngine)
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ImportError, match="mcore-agentic"):
            build_engine(RolloutConfig(name="sglang"), spec, device="cpu", seed=0)
