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
