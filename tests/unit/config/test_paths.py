"""Relative input paths resolve the same from any working directory, and a missing one names key, path and dirs."""

from __future__ import annotations

from mcore_agentic.config import compose, load_config
from mcore_agentic.config.paths import REPO_ROOT, missing_inputs, resolve_input_paths, search_dirs


def test_shipped_relative_paths_resolve_against_the_repository_from_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("{}\n")
    own = tmp_path / "my_config_dir"
    (own / "tools").mkdir(parents=True)
    (own / "tools" / "t.yaml").write_text("tools: []\n")
    data = {
        "rollout": {"multi_turn": {"tool_config_path": "configs/tools/gsm8k_tool_config.yaml",
                                   "interaction_config_path": "tools/t.yaml"}},
        "data": {"train_files": ["train.jsonl"], "val_files": "missing.parquet"},
        "reward": {"custom_reward_function": "configs/rewards/tool_arith_shaped.py:compute_score"},
        "model": {"model_path": "outputs/models/tiny_qwen2"},
    }
    dirs = search_dirs([own])
    assert dirs == [tmp_path.resolve(), own.resolve(), REPO_ROOT]
    out = resolve_input_paths(data, dirs)
    mt = out["rollout"]["multi_turn"]
    assert mt["tool_config_path"] == str(REPO_ROOT / "configs/tools/gsm8k_tool_config.yaml")  # the repository's
    assert mt["interaction_config_path"] == str(own.resolve() / "tools/t.yaml")  # the user's config directory
    assert out["data"]["train_files"] == [str(tmp_path.resolve() / "train.jsonl")]  # the working directory first
    assert out["data"]["val_files"] == "missing.parquet"  # found nowhere: left as written
    assert out["reward"]["custom_reward_function"] == str(REPO_ROOT / "configs/rewards/tool_arith_shaped.py") + ":compute_score"


def test_a_missing_input_names_the_key_the_path_and_every_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(compose("gsm8k_multiturn_grpo"))
    errors = {e.field: str(e) for e in missing_inputs(cfg, search_dirs())}
    assert set(errors) == {"data.train_files", "data.val_files", "model.model_path"}
    assert errors["data.train_files"] == (
        f"data.train_files: data/gsm8k/train.parquet not found (relative paths are looked up in: {tmp_path.resolve()}, "
        f"{REPO_ROOT})"
    )
    # The tiny model is created on first use: never missing.
    assert missing_inputs(load_config(compose("default_tiny")), search_dirs()) == []
    # load_config resolved the shipped relative path against the repository, from this other directory.
    assert cfg.rollout.multi_turn.tool_config_path == str(REPO_ROOT / "configs/tools/gsm8k_tool_config.yaml")


def test_a_checkpoint_to_resume_from_is_never_taken_from_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = {"trainer": {"resume_from_path": "configs"}, "rollout": {"multi_turn": {"tool_config_path": "configs"}}}
    out = resolve_input_paths(data, search_dirs())
    assert out["trainer"]["resume_from_path"] == "configs"  # the user's own outputs: the working directory only
    assert out["rollout"]["multi_turn"]["tool_config_path"] == str(REPO_ROOT / "configs")
