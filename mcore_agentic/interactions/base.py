"""The interaction plug-in interface: a simulated user that answers the model between turns.

Lifecycle per rollout request: ``start_interaction`` -> ``generate_response``
(each time the model finishes a turn without a tool call) ->
``calculate_score`` -> ``finalize_interaction``. Samples choose an
interaction by name (``interaction_kwargs.name``), see
:func:`mcore_agentic.interactions.registry.select_interaction`.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol, runtime_checkable

from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.utils.instance_state import InstanceState


@runtime_checkable
class InteractionProtocol(Protocol):
    name: str
    max_user_turns: int | None

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str: ...

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]: ...

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float: ...

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None: ...


class BaseInteraction(InstanceState):
    """Base class for interactions.

    ``config["name"]`` is how samples select it (the registry fills it in).
    ``config["max_user_turns"]`` (optional, int >= 0) caps the interaction turns
    of one request; ``None`` defers to the rollout's own limit. The caller (the
    agent loop) enforces it.
    """

    def __init__(self, config: dict[str, Any]):
        self.config = dict(config or {})
        name = self.config.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError("name", f"an interaction needs a non-empty string name, got {name!r}")
        self.name: str = name
        max_turns = self.config.get("max_user_turns")
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 0):
            raise ConfigError("config.max_user_turns", f"must be an integer >= 0 or null, got {max_turns!r}")
        self.max_user_turns: int | None = max_turns
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start per-request state (``kwargs`` are the sample's ``interaction_kwargs``); returns the id."""
        if instance_id is None:
            instance_id = uuid.uuid4().hex
        self._instances[instance_id] = dict(kwargs)
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Reply to the conversation so far: ``(should_terminate, user_text, turn_score, extra)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_response()")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The request's interaction score once it ends."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Free per-request state; safe for unknown ids."""
        self._instances.pop(instance_id, None)


    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def last_assistant_content(messages: list[dict[str, Any]]) -> str:
    """Text of the latest assistant message ('' if none): what an interaction usually judges."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):  # multi-part content: join the text parts
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return ""
    return ""
