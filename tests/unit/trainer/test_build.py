"""Small builders of the run: the LR schedule's horizon honours ``<worker>.optim.total_training_steps``."""

from __future__ import annotations

from mcore_agentic.workers.config import OptimConfig
from mcore_agentic.workers.engine import decay_horizon


def test_decay_horizon_is_the_configured_one_or_the_runs():
    assert decay_horizon(OptimConfig(), 120) == 120  # -1: the trainer's count
    assert decay_horizon(OptimConfig(total_training_steps=500), 120) == 500  # set in YAML: honoured


def test_routing_replay_needs_a_mixture_of_experts_model_and_an_engine_that_records(tmp_path):
    import pytest

    from mcore_agentic.config.schema import ModelConfig, RLConfig
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines import build_engine
    from mcore_agentic.trainer.build import replay_routing_shape
    from mcore_agentic.utils.errors import ConfigError
    from mcore_agentic.workers.config import ActorConfig, MoEConfig
    from tests.unit.models._hf_fixtures import make_tiny_hf

    dense, moe = make_tiny_hf("Qwen3ForCausalLM", tmp_path / "d"), make_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "m")

    def cfg(path, mode):
        return RLConfig(model=ModelConfig(model_path=str(path)), actor=ActorConfig(moe=MoEConfig(routing_replay=mode)))

    assert replay_routing_shape(cfg(moe, "disable")) is None
    assert replay_routing_shape(cfg(moe, "measure")) == (2, 2)  # every layer is MoE, top-2
    with pytest.raises(ConfigError, match="dense") as err:
        replay_routing_shape(cfg(dense, "rollout"))
    assert err.value.field == "actor.moe.routing_replay"
    with pytest.raises(ConfigError, match="rollout.name=vllm"):
        build_engine(RolloutConfig(name="vllm"), moe, device="cpu", dtype="float32", seed=0, routing_shape=(2, 2))
