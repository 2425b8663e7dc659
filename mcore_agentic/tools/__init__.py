"""Tool plug-ins (create / execute / calc_reward / release) loaded from YAML by class path."""
