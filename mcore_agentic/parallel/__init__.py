"""Parallel layout (TP/PP/CP/DP), CP sequence split and vocab-parallel logprob/entropy."""
