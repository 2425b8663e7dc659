"""Megatron -> rollout-engine weight resharding in bounded buckets, and the memory choreography around rollouts."""
