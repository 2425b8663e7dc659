"""Per-request instance state of tools and interactions as plain data, for paused requests in checkpoints.

A tool or interaction keeps each request's state in dicts keyed by instance id: ``_instances`` (the base
classes' create kwargs) and whatever attributes it names in ``instance_state_attrs`` (e.g. ``("_state",)``).
"""

from __future__ import annotations

import copy
from typing import Any


def export_instance(owner: Any, instance_id: str) -> dict[str, Any]:
    """A deep copy of every per-instance entry ``owner`` keeps for ``instance_id``."""
    attrs = ("_instances", *getattr(owner, "instance_state_attrs", ()))
    return {attr: copy.deepcopy(getattr(owner, attr).get(instance_id)) for attr in attrs}


def import_instance(owner: Any, instance_id: str, state: dict[str, Any]) -> None:
    """Put back what :func:`export_instance` returned, into an instance just re-created with the same id."""
    for attr, value in state.items():
        if value is not None:
            getattr(owner, attr)[instance_id] = copy.deepcopy(value)


class InstanceState:
    """Mixin of the tool and interaction base classes: a paused request's instance state in a checkpoint."""

    instance_state_attrs: tuple[str, ...] = ()
    """Attributes (dicts keyed by instance id) holding per-request state besides ``_instances``: a subclass
    keeping state elsewhere names them, or overrides ``export_state``/``import_state``."""

    def export_state(self, instance_id: str) -> Any:
        """The instance's state as plain (picklable) data."""
        return export_instance(self, instance_id)

    def import_state(self, instance_id: str, state: Any) -> None:
        """Restore what :meth:`export_state` returned, into an instance just re-created with the same id."""
        import_instance(self, instance_id, state)

