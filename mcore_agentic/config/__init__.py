"""Structured run config: the tree of per-package dataclasses, Hydra loading and cross-group validation.

    from mcore_agentic.config import compose, load_config, validate
    cfg = load_config(compose("ppo_trainer", ["actor.tensor_model_parallel_size=2"]))
    sizes = validate(cfg, world_size)

verl's key names (``actor_rollout_ref.actor.optim.lr``) are accepted on the command line
(:func:`translate_overrides`) and in YAML (:func:`load_config`): :mod:`mcore_agentic.config.verl_translate`
applies the table of :mod:`mcore_agentic.config.verl_keys`. Every problem of a config is reported at once (:class:`ConfigErrors`).

Every package's ``config.py`` imports :mod:`mcore_agentic.utils.errors`, and the
tree imports every package's ``config.py``; so this ``__init__`` imports nothing
eagerly and resolves the names below on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigError": "mcore_agentic.utils.errors",
    "ConfigErrors": "mcore_agentic.utils.errors",
    "require": "mcore_agentic.utils.errors",
    "RLConfig": "mcore_agentic.config.schema",
    "CONFIG_DIR": "mcore_agentic.config.load",
    "check_overrides": "mcore_agentic.config.load",
    "compose": "mcore_agentic.config.load",
    "load_config": "mcore_agentic.config.load",
    "translate_config": "mcore_agentic.config.verl_translate",
    "translate_overrides": "mcore_agentic.config.verl_translate",
    "build": "mcore_agentic.utils.walk",
    "to_dict": "mcore_agentic.utils.walk",
    "BatchSizes": "mcore_agentic.config.rules",
    "PPOBatchSizes": "mcore_agentic.config.rules",
    "validate": "mcore_agentic.config.rules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mcore_agentic.config' has no attribute {name!r}")
