"""Interaction plug-ins (simulated users) loaded from YAML by class path."""

from mcore_agentic.interactions.base import BaseInteraction, InteractionProtocol

__all__ = ["BaseInteraction", "InteractionProtocol"]
