"""Build interactions from YAML (verl's format) and pick one per sample by name.

.. code-block:: yaml

    interaction:
      - name: gsm8k                       # samples select it with interaction_kwargs.name
        class_name: mcore_agentic.interactions.gsm8k.GSM8KInteraction
        config: {max_user_turns: 2}

``name`` may be left out: it then defaults to the class name, lower-cased,
without an ``Interaction`` suffix (``GSM8KInteraction`` -> ``gsm8k``), as in verl.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mcore_agentic.interactions.base import BaseInteraction, InteractionProtocol
from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.utils.plugins import PluginKind, build_plugins, read_plugins

_METHODS = ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")


def default_name(cls: type) -> str:
    name = cls.__name__
    if name.lower().endswith("interaction") and len(name) > len("interaction"):
        name = name[: -len("interaction")]
    return name.lower()


def _check_class(cls: type, field: str) -> None:
    if issubclass(cls, BaseInteraction):
        return
    for method in _METHODS:
        fn = getattr(cls, method, None)
        if fn is None or not inspect.iscoroutinefunction(fn):
            raise ConfigError(field, f"{cls.__qualname__} lacks 'async def {method}'; subclass mcore_agentic.interactions.base.BaseInteraction")


def _name(entry: Mapping[str, Any], cls: type, config: dict[str, Any], field: str) -> tuple[str, None]:
    """``name``, else ``config.name``, else :func:`default_name`; the two keys may not disagree."""
    name = entry.get("name", config.get("name")) or default_name(cls)
    if not isinstance(name, str):
        raise ConfigError(f"{field}.name", f"must be a string, got {name!r}")
    if "name" in config and config["name"] != name:
        raise ConfigError(f"{field}.config.name", f"{config['name']!r} disagrees with {field}.name={name!r}; drop one")
    return name, None


# What an interaction is; the YAML, class paths, config mappings, unique names and one-line errors are the loader's.
INTERACTIONS = PluginKind(
    key="interaction", noun="interaction", keys=("name", "class_name", "config"),
    example="mcore_agentic.interactions.gsm8k.GSM8KInteraction", check_class=_check_class, describe=_name, name_key="name",
    construct=lambda entry: entry.cls({**entry.config, "name": entry.name}), protocol=InteractionProtocol,
)


def load_interactions(config: str | Path | Sequence[Mapping[str, Any]] | None) -> dict[str, BaseInteraction]:
    """Interactions by name, from a YAML file (``interaction:`` list) or an already-loaded list, through the shared
    plug-in loader (:mod:`mcore_agentic.utils.plugins`): every entry is checked before any is built."""
    if config is None:
        return {}
    return build_plugins(read_plugins(config, INTERACTIONS), INTERACTIONS)


def select_interaction(interactions: Mapping[str, BaseInteraction], interaction_kwargs: Mapping[str, Any] | None) -> BaseInteraction:
    """The interaction a sample asks for (``interaction_kwargs["name"]``); the only one if it names none.

    Raises :class:`ConfigError` (bad sample data) naming ``interaction_kwargs.name`` and the known names.
    """
    name = (interaction_kwargs or {}).get("name")
    if name is None:
        if len(interactions) == 1:
            return next(iter(interactions.values()))
        raise ConfigError("interaction_kwargs.name", f"missing and {len(interactions)} interactions are configured; set it to one of {sorted(interactions)}")
    if name not in interactions:
        raise ConfigError("interaction_kwargs.name", f"unknown interaction {name!r}; configured: {sorted(interactions) or 'none (set rollout.multi_turn.interaction_config_path)'}")
    return interactions[name]
