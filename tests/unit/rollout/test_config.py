"""RolloutConfig validation: bad values name ``rollout.<field>``."""

from __future__ import annotations

import pytest

from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.utils.errors import ConfigError


def test_defaults_and_effective_max_model_len():
    cfg = RolloutConfig()
    assert cfg.multi_turn.tokenization_sanity_check_mode == "strict"
    assert cfg.effective_max_model_len == cfg.prompt_length + cfg.response_length
    assert RolloutConfig(max_model_len=200).effective_max_model_len == 200


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "rollout.n"),
        ({"top_p": 0.0}, "rollout.top_p"),
        ({"top_k": 0}, "rollout.top_k"),
        ({"temperature": -1.0}, "rollout.temperature"),
        ({"name": "trtllm"}, "rollout.name"),
        ({"max_model_len": 100, "prompt_length": 128}, "rollout.max_model_len"),
        ({"tensor_model_parallel_size": 0}, "rollout.tensor_model_parallel_size"),
        ({"name": "vllm", "tensor_model_parallel_size": 2}, "rollout.tensor_model_parallel_size"),
        ({"kv_cache_memory_mb": 0}, "rollout.kv_cache_memory_mb"),
    ],
)
def test_bad_rollout_values(kwargs, field):
    with pytest.raises(ConfigError) as err:
        RolloutConfig(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_assistant_turns": 0}, "max_assistant_turns"),
        ({"tokenization_sanity_check_mode": "lenient"}, "tokenization_sanity_check_mode"),
        ({"format": "xml"}, "format"),
        ({"tool_executor": "dask"}, "tool_executor"),
        ({"tool_timeout": 0}, "tool_timeout"),
        ({"max_parallel_calls": 0}, "max_parallel_calls"),
        ({"max_user_turns": -1}, "max_user_turns"),
        ({"tokenizer_threads": -1}, "tokenizer_threads"),
    ],
)
def test_bad_multi_turn_values(kwargs, field):
    with pytest.raises(ConfigError) as err:
        MultiTurnConfig(**kwargs)
    assert err.value.field == f"rollout.multi_turn.{field}"
    assert "use" in str(err.value) or "must" in str(err.value)
