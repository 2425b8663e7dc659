"""What a resume tells the user: a finished run has nothing to do, and which settings changed since the checkpoint.

A checkpoint stores the run's config (``config.json``). At resume the keys whose values differ from this
run's are listed, one line each; the optimizer and learning-rate schedule keys say whose value wins
(``trainer.resume_optim_from``), the rest take this run's value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"

# Keys whose checkpoint value wins under ``trainer.resume_optim_from=checkpoint`` (the optimizer's state and the
# LR scheduler's settings are restored with it); clip_grad is read from the config at every step.
_OPTIM_GROUPS = ("actor.optim.", "critic.optim.")
_ALWAYS_CONFIG = ("clip_grad",)
# Keys that only move the schedule's decay horizon (when optim.total_training_steps is unset).
_HORIZON = ("trainer.total_training_steps", "trainer.total_epochs")
# Keys that naturally differ between the run that saved and the run that resumes.
_IGNORED = ("trainer.resume_mode", "trainer.resume_from_path")


class RunComplete(Exception):
    """The checkpoint resumed from is already at the run's last step: there is nothing to train."""

    def __init__(self, step: int, path: str):
        self.step = step
        self.path = path
        super().__init__(
            f"already complete at step {step} ({path}): nothing to do (new trainer.experiment_name, or "
            "trainer.resume_mode=disable to start over, or raise trainer.total_training_steps to train on)"
        )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> leaf values of a nested mapping (lists are leaves)."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def saved_config(checkpoint: str | Path) -> dict[str, Any] | None:
    """The config a checkpoint was saved with (None when it holds none or it is unreadable)."""
    path = Path(checkpoint) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every key that differs, sorted by key (JSON-normalised values).

    Keys the saved config does not have (settings added since it was written) are not changes; nor is a relative
    input path that now reads as the absolute path it resolved to."""
    old = flatten(json.loads(json.dumps(saved, default=str)))
    new = flatten(json.loads(json.dumps(current, default=str)))
    changes = []
    for key in sorted(old):
        if key in _IGNORED or key not in new:
            continue
        a, b = old[key], new[key]
        if a != b and not _same_path(a, b):
            changes.append((key, a, b))
    return changes


def _same_path(a: Any, b: Any) -> bool:
    """``a`` relative and ``b`` the absolute path it resolves to (item by item for lists of files)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(x == y or _same_path(x, y) for x, y in zip(a, b))
    if not isinstance(a, str) or not isinstance(b, str) or not a or a.startswith("/"):
        return False
    return b.startswith("/") and b.endswith("/" + a.lstrip("./"))


def who_wins(key: str, optim_from: str) -> str:
    """Whose value the resumed run uses for ``key``."""
    if key.startswith(_OPTIM_GROUPS) and key.rsplit(".", 1)[-1] not in _ALWAYS_CONFIG:
        if optim_from == "checkpoint":
            return "the checkpoint's is used (trainer.resume_optim_from=config uses yours)"
        return "yours is used (trainer.resume_optim_from=config)"
    if key in _HORIZON:
        if optim_from == "checkpoint":
            return "yours is used; the LR schedule's decay horizon stays the checkpoint's (trainer.resume_optim_from=config moves it)"
        return "yours is used, and the LR schedule's decay horizon follows it (trainer.resume_optim_from=config)"
    return "yours is used"


def describe_changes(changes: list[tuple[str, Any, Any]], optim_from: str) -> list[str]:
    """One line per changed key: ``key: saved -> current (whose value wins)``."""
    return [f"  {key}: {old!r} -> {new!r}: {who_wins(key, optim_from)}" for key, old, new in changes]
