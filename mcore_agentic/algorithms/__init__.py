"""RL math as pure tensor functions: advantages, policy/value losses, KL, loss aggregation."""
