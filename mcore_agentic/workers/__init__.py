"""Actor, reference, critic and teacher, each over its own Megatron model (``.model``).

Modules (import them directly; nothing heavy is imported here):

- ``config``: ``ActorConfig`` / ``RefConfig`` / ``CriticConfig`` / ``OptimConfig`` (light imports);
- ``megatron_model``: ``MegatronModel`` — bridge build, pipeline schedule, CP split/gather,
  micro-batching; ``forward_only`` / ``forward_backward`` / ``step``;
- ``optimizer``: a trained model's DDP wrapper, optimizer and LR schedule;
- ``actor``: ``Actor.compute_log_prob`` / ``update_policy`` / ``sft_step``;
- ``reference``: ``Reference.compute_ref_log_prob``;
- ``critic``: ``Critic.compute_values`` / ``update_critic`` (zero-initialised value head);
- ``passes``: what the workers share (log-prob head, PPO epochs over mini-batches, key checks);
- ``sequence``, ``offload``: left-padding removal, response mapping and (token-budget)
  micro-batches; storage-level offload to CPU and back.
"""
