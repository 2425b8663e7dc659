"""The PPO/GRPO step loop, metrics, logging and checkpoints."""
