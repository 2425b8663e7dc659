"""A token-exact OpenAI / Anthropic-compatible session endpoint in front of a rollout engine (docs/agents.md)."""
