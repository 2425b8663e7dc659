"""Interaction plug-ins (simulated users) loaded from YAML by class path."""
