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
from mcore_agentic.tools.registry import import_path_of, plain, read_yaml_list, resolve_class
from mcore_agentic.utils.errors import ConfigError

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


def load_interactions(config: str | Path | Sequence[Mapping[str, Any]] | None) -> dict[str, BaseInteraction]:
    """Interactions by name, from a YAML file (``interaction:`` list) or an already-loaded list."""
    if config is None:
        return {}
    if isinstance(config, str | Path):
        entries, where = read_yaml_list(config, "interaction"), f"{config}: interaction"
        import_path_of(config)
    else:
        entries, where = plain(config), "interaction"
        if not isinstance(entries, list):
            raise ConfigError(where, f"must be a list of interaction entries, got {type(entries).__name__}")
    built: dict[str, BaseInteraction] = {}
    first_index: dict[str, int] = {}
    for i, entry in enumerate(entries):
        field = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(field, "each interaction entry must be a mapping with name, class_name, config")
        unknown = set(entry) - {"name", "class_name", "config"}
        if unknown:
            raise ConfigError(f"{field}.{sorted(unknown)[0]}", "unknown key; an interaction entry holds name, class_name, config")
        cls = resolve_class(entry.get("class_name"), f"{field}.class_name")
        _check_class(cls, f"{field}.class_name")
        config_map = entry.get("config") or {}
        if not isinstance(config_map, dict):
            raise ConfigError(f"{field}.config", f"must be a mapping, got {type(config_map).__name__}")
        name = entry.get("name", config_map.get("name")) or default_name(cls)
        if not isinstance(name, str):
            raise ConfigError(f"{field}.name", f"must be a string, got {name!r}")
        if "name" in config_map and config_map["name"] != name:
            raise ConfigError(f"{field}.config.name", f"{config_map['name']!r} disagrees with {field}.name={name!r}; drop one")
        if name in first_index:
            raise ConfigError(f"{field}.name", f"duplicate interaction name {name!r} (also {where}[{first_index[name]}])")
        try:
            interaction = cls({**config_map, "name": name})
        except ConfigError as exc:
            raise ConfigError(f"{field}.{exc.field}", str(exc).split(": ", 1)[-1]) from None
        if not isinstance(interaction, InteractionProtocol):
            raise ConfigError(f"{field}.class_name", f"{cls.__qualname__} instances do not satisfy the interaction interface")
        first_index[name] = i
        built[name] = interaction
    return built


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
