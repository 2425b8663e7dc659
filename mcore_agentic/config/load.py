"""Load the run's Hydra config into :class:`RLConfig`: compose YAML, translate verl's keys, check overrides, convert.

The conversion rules (unknown keys with "did you mean", types, literals, flattened sub-groups) live in
:mod:`mcore_agentic.utils.walk`. verl's keys are translated by :mod:`mcore_agentic.config.verl_translate` (the
table: :mod:`mcore_agentic.config.verl_keys`), on the command line before Hydra composes
(:func:`translate_overrides`, re-exported here) and in the composed tree (:func:`translate_config`; one INFO line
per key on the ``mcore_agentic.config.load`` logger).

A refused key (its meaning differs here), a value set under both names that disagrees, an unknown key, a wrong
type: every problem of a config is reported at once (one :class:`~mcore_agentic.utils.errors.ConfigErrors`,
one ``field: message`` line each).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from mcore_agentic.config.key_hints import suggest_key
from mcore_agentic.config.paths import CONFIG_DIR, resolve_input_paths
from mcore_agentic.config.paths import search_dirs as default_dirs
from mcore_agentic.config.schema import RLConfig, native_leaves
from mcore_agentic.config.verl_translate import plan_overrides, translate_config, translate_overrides
from mcore_agentic.utils.errors import ConfigError, raise_errors
from mcore_agentic.utils.walk import build, to_dict

__all__ = [
    "CONFIG_DIR", "build", "check_overrides", "compose", "load_config", "to_dict", "translate_config",
    "translate_overrides",
]

logger = logging.getLogger(__name__)


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


def load_config(
    cfg: DictConfig | Mapping[str, Any],
    *,
    overrides: Sequence[str] | None = None,
    search_dirs: Sequence[str | os.PathLike] | None = None,
    log_aliases: bool = True,
) -> RLConfig:
    """The frozen :class:`RLConfig` of a composed Hydra config.

    verl's keys in the tree are moved to their native keys first (:func:`translate_config`; one INFO line each on
    this module's logger unless ``log_aliases`` is false). ``overrides``: the command line the config was composed
    with (default: the running Hydra job's, if any), so that a native key given there wins over a verl key in a
    YAML file. ``search_dirs``: relative input paths (model, data, tool YAML ...) are resolved against these
    (:func:`mcore_agentic.config.paths.resolve_input_paths`; default: the working directory, then the repository). Raises :class:`ConfigError` naming the full key, or
    :class:`~mcore_agentic.utils.errors.ConfigErrors` with every problem when there are several.
    """
    data = _plain(cfg)
    if overrides is None:
        overrides = _hydra_job_overrides()
    data, lines, errors = translate_config(data, overrides)
    if log_aliases:
        for line in lines:
            logger.info(line)
    resolve_input_paths(data, [Path(d) for d in search_dirs] if search_dirs is not None else default_dirs())
    try:
        out = build(RLConfig, data)
    except ConfigError as e:
        errors += e.errors
    raise_errors(errors)
    return out


def _hydra_job_overrides() -> list[str]:
    """The command-line overrides of the running ``@hydra.main`` job (empty outside one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 -- no Hydra job: no command line to honour
        pass
    return []


def check_overrides(overrides: Sequence[str]) -> None:
    """Reject every bad command-line override at once, each with what to write instead.

    Hydra alone reports only "Key 'x' is not in struct", one key per launch; this names the nearest real key for
    every unknown key, refuses verl keys whose meaning differs here (with the replacement), verl values that cannot
    be translated and a key given under both names with two values. verl's aliases and keys not needed here pass
    (:func:`translate_overrides` rewrites or drops them). Group selections (``model=qwen2_5_7b``) and
    ``+``/``++``/``~`` overrides pass through (additions are still checked when the composed tree is loaded).
    Raises :class:`ConfigError` (one problem) or :class:`~mcore_agentic.utils.errors.ConfigErrors`.
    """
    plan = plan_overrides(overrides)
    leaves = sorted(native_leaves())
    errors: list[tuple[int, ConfigError]] = []
    for o in plan.unknown:
        if o.prefix or o.text is None:
            continue
        parent, _, last = o.key.rpartition(".")
        siblings = [leaf.rpartition(".")[2] for leaf in leaves if leaf.rpartition(".")[0] == parent]
        errors.append((o.index, ConfigError(o.key, f"unknown key; {suggest_key(last, parent, siblings, leaves)}")))
    position = {o.split("=", 1)[0].lstrip("+~"): i for i, o in reversed(list(enumerate(overrides)))}
    errors += [(position.get(e.field, len(overrides)), e) for e in plan.errors]
    raise_errors(e for _, e in sorted(errors, key=lambda pair: pair[0]))


def compose(
    config_name: str = "ppo_trainer",
    overrides: Sequence[str] = (),
    config_dir: str | os.PathLike | None = None,
) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with command-line style overrides (no working-dir change).

    verl's keys among ``overrides`` are translated first (:func:`translate_overrides`; one INFO line each).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    rewritten, lines = translate_overrides(list(overrides))
    for line in lines:
        logger.info(line)
    check_overrides(rewritten)
    directory = Path(config_dir) if config_dir is not None else CONFIG_DIR
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=rewritten)

