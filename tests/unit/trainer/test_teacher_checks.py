"""A distillation teacher must score the student's ids as they are: the pre-flight refuses, one line each, a teacher
with another tokenizer or chat template, or one the actor's layout cannot split; a teacher of another size passes."""

from __future__ import annotations

import pytest

from mcore_agentic.config import compose, load_config
from mcore_agentic.models.tiny import make_tiny_hf_model
from mcore_agentic.trainer.build import build_tokenizer, check_teacher_tokenizer
from mcore_agentic.trainer.preflight import check_teacher
from mcore_agentic.utils.errors import ConfigError


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {
        "student": make_tiny_hf_model(root / "student", vocab_size=512),
        "wider": make_tiny_hf_model(root / "wider", vocab_size=512, hidden_size=128, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, seed=3),
        "vocab": make_tiny_hf_model(root / "vocab", vocab_size=640),
        "template": make_tiny_hf_model(root / "template", vocab_size=512, chat_template="qwen3"),
        "three_layers": make_tiny_hf_model(root / "three", vocab_size=512, num_hidden_layers=3),
    }


def _problems(models, teacher: str, *overrides: str) -> list[ConfigError]:
    cfg = load_config(compose("ppo_trainer", [f"model.model_path={models['student']}",
                                              f"teacher.model_path={models[teacher]}", *overrides]))
    return check_teacher(cfg)


def test_a_teacher_of_another_size_sharing_the_tokenizer_passes(models):
    assert _problems(models, "wider") == []
    assert _problems(models, "wider", "actor.pipeline_model_parallel_size=2") == []


def test_another_tokenizer_or_chat_template_is_refused_in_one_line(models):
    (vocab,) = _problems(models, "vocab")
    assert vocab.field == "teacher.model_path" and "another tokenizer" in str(vocab) and "\n" not in str(vocab)
    (template,) = _problems(models, "template")
    assert template.field == "teacher.model_path" and "chat template differs" in str(template)
    with pytest.raises(ConfigError, match="must share the student's tokenizer"):
        check_teacher_tokenizer(build_tokenizer(models["student"]), models["vocab"])


def test_a_teacher_the_actors_layout_cannot_split_is_refused(models):
    (split,) = _problems(models, "three_layers", "actor.pipeline_model_parallel_size=2")
    assert split.field == "teacher.model_path"
    assert "actor's layout" in str(split) and "num_layers=3" in str(split)


def test_a_teacher_on_its_own_split_is_checked_against_its_own_sizes(models):
    """``teacher.tensor_model_parallel_size``: the teacher's own TP must divide its heads (the actor's layout no longer
    matters: a 3-layer teacher beside a PP=2 actor is fine) and the world size — one line naming the key."""
    own = "teacher.tensor_model_parallel_size"
    assert _problems(models, "three_layers", "actor.pipeline_model_parallel_size=2", f"{own}=2") == []
    (heads,) = _problems(models, "wider", f"{own}=8")
    assert heads.field == own and "num_attention_heads=4" in str(heads) and "\n" not in str(heads)
    from mcore_agentic.config.rules import validate

    cfg = load_config(compose("ppo_trainer", [f"model.model_path={models['student']}",
                                              f"teacher.model_path={models['wider']}", f"{own}=4"]))
    with pytest.raises(ConfigError) as info:
        validate(cfg, 6)
    assert info.value.field == own and "world size 6" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(compose("ppo_trainer", [f"teacher.model_path={models['wider']}", f"{own}=0"]))
    assert own in str(info.value)


def test_a_top_k_beyond_the_vocabulary_is_refused(models):
    (wide,) = _problems(models, "wider", "algorithm.distillation.top_k=100000")
    assert wide.field == "algorithm.distillation.top_k" and "tokenizer's" in str(wide)
    assert _problems(models, "wider", "algorithm.distillation.top_k=8") == []
