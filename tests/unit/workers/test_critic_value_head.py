"""The critic's value head on a checkpoint with tied embeddings (at PP=1 megatron's output layer has no weight)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import make_batch, setup_rank


def _values(rank: int, world_size: int, path: str) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    from mcore_agentic.models.bridge import unwrap_model
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.workers.config import CriticConfig
    from mcore_agentic.workers.critic import Critic

    par, layout = setup_rank(1)
    critic = Critic(CriticConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2),
                    ModelSpec(path, "float32", parallel=par), layout, mini_batch_sequences=8)
    head = unwrap_model(critic.model.chunks[-1]).output_layer.weight
    values = critic.compute_values(make_batch(4))["values"]
    return tuple(values.shape), tuple(head.shape), str(head.dtype)


def test_value_head_on_tied_embeddings(tmp_path: Path) -> None:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "tied"))
    values, head, dtype = run_distributed(_values, 1, args=(str(tmp_path / "tied"),))[0]
    assert values == (4, 10) and head == (1, 64) and dtype == "torch.float32"
