"""Small builders of the run: the LR schedule's horizon honours ``<worker>.optim.total_training_steps``."""

from __future__ import annotations

from mcore_agentic.workers.config import OptimConfig
from mcore_agentic.workers.optimizer import decay_horizon


def test_decay_horizon_is_the_configured_one_or_the_runs():
    assert decay_horizon(OptimConfig(), 120) == 120  # -1: the trainer's count
    assert decay_horizon(OptimConfig(total_training_steps=500), 120) == 500  # set in YAML: honoured


def test_routing_replay_needs_a_mixture_of_experts_model_and_an_engine_that_records(tmp_path):
    import pytest

    from mcore_agentic.config.schema import ModelConfig, RLConfig
    from mcore_agentic.models.spec import ModelSpec
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
        build_engine(RolloutConfig(name="vllm"), ModelSpec(moe, "float32", routing_shape=(2, 2)), device="cpu", seed=0)


def test_model_spec_is_built_once_from_the_config(tmp_path):
    from mcore_agentic.config.schema import ModelConfig, RLConfig
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.trainer.build import model_spec
    from mcore_agentic.workers.config import ActorConfig, MoEConfig
    from tests.unit.models._hf_fixtures import make_tiny_hf

    moe = make_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "m")
    par = ParallelConfig(expert_model_parallel_size=2)
    cfg = RLConfig(
        model=ModelConfig(model_path=str(moe), dtype="bfloat16", transformer_impl="local", use_remove_padding=False,
                          make_vocab_size_divisible_by=64),
        actor=ActorConfig(parallel=par, moe=MoEConfig(routing_replay="rollout")),
        rollout=RolloutConfig(temperature=0.7),
    )
    spec = model_spec(cfg, vocab_size=300)
    assert (spec.model_path, spec.dtype, spec.transformer_impl, spec.use_remove_padding) == (
        str(moe), "bfloat16", "local", False)
    assert (spec.make_vocab_size_divisible_by, spec.vocab_size, spec.temperature) == (64, 300, 0.7)
    assert spec.routing_shape == (2, 2) and spec.parallel is par
    greedy = RLConfig(model=ModelConfig(model_path=str(moe)), rollout=RolloutConfig(temperature=0.0))
    assert model_spec(greedy, vocab_size=None).temperature == 1.0  # greedy rollouts: temperature-1 log-probs
