"""Load the run's Hydra config into :class:`RLConfig`: compose YAML, check overrides, convert.

The conversion rules (unknown keys with "did you mean", types, literals,
flattened sub-groups) live in :mod:`mcore_agentic.config.walk`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from mcore_agentic.config.errors import ConfigError
from mcore_agentic.config.schema import RLConfig
from mcore_agentic.config.walk import build, leaf_paths, suggest_key, to_dict

__all__ = ["CONFIG_DIR", "build", "check_overrides", "compose", "load_config", "to_dict"]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The repository's Hydra config directory (``configs/``)."""


def _plain(cfg: Any) -> dict[str, Any]:
    """A resolved plain dict from an OmegaConf node or mapping; interpolation and ``???`` errors name the key."""
    if isinstance(cfg, DictConfig):
        try:
            data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as e:
            raise ConfigError(str(e.full_key), "is required (??? in the YAML); set it on the command line") from None
        except OmegaConfBaseException as e:
            raise ConfigError(str(getattr(e, "full_key", "") or "config"), str(e).splitlines()[0]) from None
    elif isinstance(cfg, Mapping):
        data = _plain(OmegaConf.create(dict(cfg)))
    else:
        raise TypeError(f"load_config expects a DictConfig or a mapping, got {type(cfg).__name__}")
    assert isinstance(data, dict)
    data.pop("hydra", None)  # Hydra's own settings, present when composed with return_hydra_config
    return data


def load_config(cfg: DictConfig | Mapping[str, Any]) -> RLConfig:
    """The frozen :class:`RLConfig` of a composed Hydra config; raises :class:`ConfigError` naming the full key."""
    return build(RLConfig, _plain(cfg))


def check_overrides(overrides: Sequence[str]) -> None:
    """Reject command-line overrides of keys the schema does not know, with a "did you mean" hint.

    Hydra alone reports only "Key 'x' is not in struct"; this names the nearest real key.
    Group selections (``model=qwen2_5_7b``) and ``+``/``++``/``~`` overrides pass through
    (additions are still checked when the composed tree is loaded).
    """
    leaves = leaf_paths(RLConfig)
    groups = {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()} if CONFIG_DIR.is_dir() else set()
    for item in overrides:
        if item.startswith(("+", "~")) or "=" not in item:
            continue
        key = item.split("=", 1)[0]
        if key in groups or key.startswith("hydra.") or key in leaves:
            continue
        if any(key.startswith(leaf + ".") for leaf in leaves):  # inside a mapping-valued field
            continue
        parent, _, last = key.rpartition(".")
        siblings = [leaf.rpartition(".")[2] for leaf in leaves if leaf.rpartition(".")[0] == parent]
        raise ConfigError(key, f"unknown key; {suggest_key(last, parent, siblings, leaves)}")


def compose(
    config_name: str = "ppo_trainer",
    overrides: Sequence[str] = (),
    config_dir: str | os.PathLike | None = None,
) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with command-line style overrides (no working-dir change)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_overrides(overrides)
    directory = Path(config_dir) if config_dir is not None else CONFIG_DIR
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
