"""Where the config's input paths point: relative paths resolved the same way from any working directory.

A relative input path (a model, data files, the tool and interaction YAMLs, a reward function's file, a
checkpoint to resume from) is looked up, in order, under the working directory (what a path typed on the
command line means), the directory of the user's own config (``--config-dir`` / ``--config-path``) and the
repository root (what the shipped configs' ``configs/tools/...`` and ``outputs/models/...`` mean). The first
directory that holds it wins and the value becomes absolute, so every rank, the checkpoint's saved config and a
later resume from elsewhere see one path. A path found nowhere stays as written; :func:`missing_inputs` then
names the key, the path and every directory it was looked for in. Output paths (logs, checkpoints, dumps) stay
relative to the working directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.utils.walk import get_dotted, set_dotted

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository (or installed source tree) root: the shipped configs' relative paths start here."""

CONFIG_DIR = REPO_ROOT / "configs"
"""The repository's Hydra config directory (``configs/``)."""

INPUT_PATHS: dict[str, str] = {
    "model.model_path": "dir",
    "critic.model_path": "dir",
    "teacher.model_path": "dir",
    "data.train_files": "file",
    "data.val_files": "file",
    "rollout.multi_turn.tool_config_path": "file",
    "rollout.multi_turn.interaction_config_path": "file",
    "reward.custom_reward_function": "file:name",
    "rollout.agent.workdir": "dir",
    "rollout.agent.sandbox_limits.extra_read_paths": "dir",
    "trainer.resume_from_path": "dir",
}
"""Input path keys and what they hold: a directory, file(s), or ``file.py:name`` (only the file part is a path)."""

OWN_OUTPUTS = ("trainer.resume_from_path",)
"""Input keys that name the user's own run outputs: never looked up in the repository."""

TINY_MODELS = "outputs/models/"
"""Model paths under here that do not exist yet are the tiny presets the trainer creates on first use."""


def search_dirs(config_dirs: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """The working directory, then ``config_dirs`` (the user's config directories), then the repository root."""
    out: list[Path] = []
    for d in (Path.cwd(), *(Path(c) for c in config_dirs), REPO_ROOT):
        d = d.resolve()
        if d not in out:
            out.append(d)
    return out


def _file_part(kind: str, value: str) -> tuple[str, str]:
    """``(path, suffix)`` of a value: a ``file.py:name`` spec keeps its ``:name`` aside; a module path has no file."""
    if kind == "file:name":
        path, sep, name = value.rpartition(":")
        if not sep or not path.endswith(".py"):
            return "", ""
        return path, sep + name
    return value, ""


def _resolve_one(value: str, kind: str, dirs: Sequence[Path]) -> str:
    path, suffix = _file_part(kind, value)
    if not path:
        return value
    expanded = Path(os.path.expanduser(path))
    if expanded.is_absolute():
        return str(expanded) + suffix
    for d in dirs:
        if (d / expanded).exists():
            return str(d / expanded) + suffix
    return value


def resolve_input_paths(data: dict[str, Any], dirs: Sequence[Path]) -> dict[str, Any]:
    """``data`` (a plain config mapping, changed in place and returned) with every input path found under
    ``dirs`` made absolute; paths found nowhere are left as written."""
    for key, kind in INPUT_PATHS.items():
        value = get_dotted(data, key)
        where = _dirs_for(key, dirs)
        if isinstance(value, str) and value:
            set_dotted(data, key, _resolve_one(value, kind, where))
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            set_dotted(data, key, [_resolve_one(v, kind, where) for v in value])
    return data


def _dirs_for(key: str, dirs: Sequence[Path]) -> list[Path]:
    return [d for d in dirs if d != REPO_ROOT] if key in OWN_OUTPUTS else list(dirs)


def _values(cfg: Any, key: str) -> list[str]:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part, None) if not isinstance(node, Mapping) else node.get(part)
        if node is None:
            return []
    if isinstance(node, str):
        return [node] if node else []
    if isinstance(node, (list, tuple)):
        return [v for v in node if isinstance(v, str) and v]
    return []


def missing_inputs(cfg: Any, dirs: Sequence[Path]) -> list[ConfigError]:
    """One error per input path that does not exist, naming the key, the path and the directories searched.

    ``cfg``: the built config (or a plain mapping). A tiny preset model under ``outputs/models/`` is created by
    the trainer and is not missing; ``trainer.resume_from_path`` is checked only when ``resume_mode`` uses it.
    """
    errors: list[ConfigError] = []
    for key, kind in INPUT_PATHS.items():
        key_dirs = _dirs_for(key, dirs)
        where = ", ".join(str(d) for d in key_dirs)
        if key == "trainer.resume_from_path" and _values(cfg, "trainer.resume_mode") != ["resume_path"]:
            continue
        for value in _values(cfg, key):
            path, _ = _file_part(kind, value)
            if not path:
                continue
            if key.endswith("model_path") and Path(path).as_posix().startswith(TINY_MODELS):
                continue
            p = Path(os.path.expanduser(path))
            if p.is_absolute():
                if not p.exists():
                    errors.append(ConfigError(key, f"{p} does not exist"))
                continue
            if not any((d / p).exists() for d in key_dirs):
                errors.append(ConfigError(key, f"{path} not found (relative paths are looked up in: {where})"))
    return errors
