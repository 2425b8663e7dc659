"""The feed's part of the pre-flight: what its plug-ins and programs need, checked before any worker starts.

:mod:`mcore_agentic.trainer.preflight` calls these (through the feed's public surface) with the config's groups: the
tools' and interactions' YAML (classes imported, not constructed), the reward function (imports, signature) and an
agent program (its entry point loads; its commands exist; a sandbox works here). Nothing here builds a tool instance,
an engine or a model.
"""

from __future__ import annotations

import os
import shlex
import shutil
from typing import Any

from mcore_agentic.rewards.config import RewardConfig
from mcore_agentic.rollout.config import AgentConfig, RolloutConfig
from mcore_agentic.utils.errors import ConfigError, collect


def check_plugins(rollout: RolloutConfig) -> tuple[dict[str, dict] | None, set[str] | None]:
    """Tool schemas and interaction names ``rollout.multi_turn`` provides (None: multi-turn off); their YAML and classes
    are checked (the classes imported, not constructed)."""
    from mcore_agentic.interactions.registry import load_interactions
    from mcore_agentic.tools.registry import load_tools

    mt = rollout.multi_turn
    if not mt.enable:
        return None, None
    tools = load_tools(mt.tool_config_path, instantiate=False) if mt.tool_config_path else {}
    interactions = set(load_interactions(mt.interaction_config_path)) if mt.interaction_config_path else set()
    return tools, interactions


def check_reward_fn(reward: RewardConfig) -> Any:
    """The run's reward function, loaded (a custom one imports and takes the reward's arguments)."""
    from mcore_agentic.rewards import build_reward_fn

    return build_reward_fn(reward)


def check_agent(a: AgentConfig) -> list[ConfigError]:
    """``rollout.agent``: the entry point loads and is callable; the command's and the reward command's programs
    exist; with ``sandbox=bwrap`` the sandbox works here and has them (one sample's sandbox is started)."""
    from mcore_agentic.endpoint.programs import CommandRunner, load_entrypoint

    problems: list[ConfigError] = []
    if a.entrypoint:
        collect(problems, lambda: load_entrypoint(a.entrypoint), "rollout.agent.entrypoint")
    for key in ("command", "reward_command") if a.command else ():
        field = f"rollout.agent.{key}"
        if getattr(a, key) is None:
            continue
        try:
            argv = shlex.split(getattr(a, key))
        except ValueError as exc:
            problems.append(ConfigError(field, f"cannot be split like a shell line: {exc}"))
            continue
        if not argv:
            problems.append(ConfigError(field, "is empty: set a command line or unset it"))
        elif "/" in argv[0] and not os.path.isabs(argv[0]) and (a.workdir or a.sandbox == "bwrap"):
            pass  # a file of the sample's work directory
        elif shutil.which(argv[0]) is None:
            problems.append(ConfigError(field, f"{argv[0]!r} is not an executable on PATH or a path to one"))
    if a.command and a.sample_dirs is not None and not (os.path.isdir(a.sample_dirs) and os.access(a.sample_dirs, os.W_OK)):
        problems.append(ConfigError("rollout.agent.sample_dirs", f"{a.sample_dirs} is not a writable directory: create "
                                    "it or unset the key (the temporary directory)"))
    if a.command and a.sandbox == "bwrap":
        for path in a.sandbox_limits.extra_read_paths:
            if not os.path.exists(path):
                problems.append(ConfigError("rollout.agent.sandbox_limits.extra_read_paths",
                                            f"{path!r} does not exist; list existing paths only"))
        if not problems:  # the sandbox proves itself on this host (as the trainer's leaders will)
            collect(problems, lambda: CommandRunner.from_config(a).close(), "rollout.agent.sandbox")
    return problems
