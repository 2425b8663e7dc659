"""Tool plug-ins (create / execute / calc_reward / release) loaded from YAML by class path."""

from mcore_agentic.tools.base import BaseTool, ToolProtocol, ToolResponse, error_response, safe_execute

__all__ = ["BaseTool", "ToolProtocol", "ToolResponse", "error_response", "safe_execute"]
