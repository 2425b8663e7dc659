"""mcore-agentic: multi-turn, tool-using RL for LLMs on Megatron-core."""
