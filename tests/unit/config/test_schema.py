"""Every YAML in configs/ composes, loads into RLConfig and validates; generated files are fresh."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mcore_agentic.config import CONFIG_DIR, ConfigError, RLConfig, compose, load_config, to_dict, validate
from mcore_agentic.config.reference import YAML_INTERPOLATIONS, render_markdown, render_yaml
from mcore_agentic.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[3]
PRESETS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
RUN_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "ppo_trainer")


def _world_size(cfg: RLConfig) -> int:
    # GPU presets are tuned for one 8-GPU node; the tiny model runs on 2 CPU processes.
    return 2 if cfg.model.model_path.endswith("_qwen2") and "/models/tiny" in cfg.model.model_path else 8


# What a config leaves for the command line (``???``), filled as its documented command fills it.
REQUIRED = {
    "byo_task": ["model.model_path=/models/Qwen2.5-3B-Instruct", "data.train_files=/data/train.parquet",
                 "rollout.multi_turn.tool_config_path=/data/tools.yaml"],
}


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_run_configs_load_and_validate(name):
    cfg = load_config(compose(name, REQUIRED.get(name, [])))
    sizes = validate(cfg, _world_size(cfg))
    assert sizes.sequences_per_step == cfg.data.train_batch_size * cfg.rollout.n


@pytest.mark.parametrize("preset", PRESETS)
def test_model_presets_load_and_validate(preset):
    cfg = load_config(compose("ppo_trainer", [f"model={preset}"]))
    assert cfg.model.model_path
    # Preset micro-batch sizes are tuned for real jobs: validate them under the example job.
    cfg = load_config(compose("gsm8k_multiturn_grpo", [f"model={preset}"]))
    validate(cfg, _world_size(cfg))


def test_base_config_needs_data():
    cfg = load_config(compose("ppo_trainer"))
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    assert info.value.field == "data.train_files"


def test_base_yaml_defaults_equal_dataclass_defaults():
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"), resolve=False)
    raw.pop("defaults")
    for key in YAML_INTERPOLATIONS:  # interpolations: compare what they resolve to
        group, name = key.split(".")
        raw[group][name] = OmegaConf.select(OmegaConf.create(raw), YAML_INTERPOLATIONS[key][2:-1])
    expected = to_dict(RLConfig(model=ModelConfig(model_path="x")))
    raw["model"]["model_path"] = "x"  # the one required key (??? in the base file)
    assert raw == expected


def test_parallel_sizes_overridable_on_command_line():
    cfg = load_config(
        compose(
            "default_tiny",
            ["actor.tensor_model_parallel_size=2", "actor.pipeline_model_parallel_size=2", "rollout.tensor_model_parallel_size=2"],
        )
    )
    assert cfg.actor.parallel.tensor_model_parallel_size == 2 and cfg.actor.parallel.pipeline_model_parallel_size == 2
    assert cfg.rollout.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="actor.pipeline_model_parallel_size: world size 2 is not divisible by TP"):
        validate(cfg, 2)
    # The same key in the composed config, frozen.
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.n = 3  # type: ignore[misc]


def test_interpolated_lengths_follow_data():
    cfg = load_config(compose("ppo_trainer", ["data.max_prompt_length=300", "data.max_response_length=70"]))
    assert (cfg.rollout.prompt_length, cfg.rollout.response_length) == (300, 70)


def test_override_typos_are_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"did you mean rollout\.multi_turn\.max_assistant_turns\?") as info:
        compose("default_tiny", ["rollout.multi_turn.max_assistant_turn=3"])
    assert info.value.field == "rollout.multi_turn.max_assistant_turn"
    with pytest.raises(ConfigError, match="expected an integer") as info:
        load_config(compose("default_tiny", ["rollout.n=two"]))
    assert info.value.field == "rollout.n"
    with pytest.raises(ConfigError) as info:
        load_config(compose("default_tiny", ["+trainer.loggers=[console]"]))
    assert "did you mean trainer.logger?" in str(info.value)


def test_generated_reference_files_are_fresh():
    assert (CONFIG_DIR / "ppo_trainer.yaml").read_text() == render_yaml(), "run python launch/dump_config_reference.py"
    assert (REPO / "docs" / "configuration.md").read_text() == render_markdown(), (
        "run python launch/dump_config_reference.py"
    )


def test_missing_and_broken_interpolation_name_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(OmegaConf.create({"model": {"model_path": "???"}}))
    assert info.value.field == "model.model_path" and "required" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(OmegaConf.create({"model": {"model_path": "x"}, "data": {"max_prompt_length": "${nowhere}"}}))
    assert info.value.field == "data.max_prompt_length"


@pytest.mark.parametrize(
    "override, hint",
    [("sharding.offload_actor_grads=true", "use actor.grad_offload"), ("sharding.flat_gather=true", "removed")],
)
def test_retired_keys_say_what_to_write_instead(override, hint):
    with pytest.raises(ConfigError) as info:
        load_config(compose("default_tiny", [override]))
    assert info.value.field == override.split("=")[0] and hint in str(info.value)
