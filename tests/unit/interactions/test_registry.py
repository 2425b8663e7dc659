"""load_interactions / select_interaction: YAML loading, default names, selection per sample, clear errors."""

import sys
from pathlib import Path

import pytest

from mcore_agentic.interactions.gsm8k import GSM8KInteraction
from mcore_agentic.interactions.registry import load_interactions, select_interaction
from mcore_agentic.utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
CLS = "mcore_agentic.interactions.gsm8k.GSM8KInteraction"


def test_shipped_yaml_loads():
    interactions = load_interactions(REPO / "configs/interactions/gsm8k_interaction_config.yaml")
    assert list(interactions) == ["gsm8k"]
    inter = interactions["gsm8k"]
    assert isinstance(inter, GSM8KInteraction) and inter.max_user_turns == 2
    assert load_interactions(None) == {}


def test_default_name_and_selection():
    interactions = load_interactions([{"class_name": CLS}, {"name": "strict_teacher", "class_name": CLS, "config": {"answer_format": "strict"}}])
    assert list(interactions) == ["gsm8k", "strict_teacher"]  # GSM8KInteraction -> "gsm8k", as verl names it
    assert select_interaction(interactions, {"name": "strict_teacher"}).settings.answer_format == "strict"
    with pytest.raises(ConfigError, match=r"interaction_kwargs.name: unknown interaction 'x'; configured: \['gsm8k', 'strict_teacher'\]"):
        select_interaction(interactions, {"name": "x"})
    with pytest.raises(ConfigError, match="interaction_kwargs.name: missing and 2 interactions"):
        select_interaction(interactions, {})
    only = {"gsm8k": interactions["gsm8k"]}
    assert select_interaction(only, None) is interactions["gsm8k"]


@pytest.mark.parametrize(
    "entries, field, text",
    [
        ([{"name": "a"}], "interaction[0].class_name", "class path"),
        ([{"class_name": "mcore_agentic.interactions.gsm8k.Nope"}], "interaction[0].class_name", "no attribute"),
        ([{"class_name": "mcore_agentic.tools.gsm8k.GSM8KTool"}], "interaction[0].class_name", "lacks 'async def start_interaction'"),
        ([{"class_name": CLS}, {"class_name": CLS}], "interaction[1].name", "duplicate interaction name 'gsm8k'"),
        ([{"class_name": CLS, "config": {"max_user_turns": -1}}], "interaction[0].config.max_user_turns", "integer >= 0"),
        ([{"class_name": CLS, "config": {"answer_format": "loose"}}], "interaction[0].config.answer_format", "loose"),
        ([{"class_name": CLS, "config": {"max_turns": 2}}], "interaction[0].config.max_turns", "did you mean"),
        ([{"name": "a", "class_name": CLS, "config": {"name": "b"}}], "interaction[0].config.name", "disagrees"),
        ([{"class_name": CLS, "kwargs": {}}], "interaction[0].kwargs", "unknown key"),
        ({"class_name": CLS}, "interaction", "must be a list"),
    ],
)
def test_bad_entries_name_the_field(entries, field, text):
    with pytest.raises(ConfigError) as info:
        load_interactions(entries)
    assert info.value.field == field, str(info.value)
    assert text in str(info.value)


def test_bad_file(tmp_path):
    (tmp_path / "i.yaml").write_text("interactions: []\n")
    with pytest.raises(ConfigError, match=r"i.yaml: interaction: missing"):
        load_interactions(tmp_path / "i.yaml")
    (tmp_path / "empty.yaml").write_text("interaction:\n")
    assert load_interactions(str(tmp_path / "empty.yaml")) == {}


def test_a_class_beside_the_yaml_imports_and_a_bad_path_shows_an_interaction_class(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "my_teacher_interactions.py").write_text(
        "from mcore_agentic.interactions.gsm8k import GSM8KInteraction\n\nclass TeacherInteraction(GSM8KInteraction):\n    pass\n")
    (tmp_path / "i.yaml").write_text("interaction:\n  - class_name: my_teacher_interactions.TeacherInteraction\n")
    try:
        assert list(load_interactions(tmp_path / "i.yaml")) == ["teacher"]
    finally:
        sys.modules.pop("my_teacher_interactions", None)
    with pytest.raises(ConfigError, match=r"interaction\[0\].class_name: must be a class path like 'mcore_agentic.interactions.gsm8k.GSM8KInteraction'"):
        load_interactions([{"class_name": "Teacher"}])
