"""Multi-turn rollout: request state machine, delta tokenization, loss masks, tool-call parsing, engines."""
