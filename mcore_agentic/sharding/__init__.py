"""Megatron -> rollout-engine weight resharding in bounded buckets around each rollout.

Entry points (import them from their modules; this package imports nothing so that
``sharding.config`` stays light for the config tree):

- :class:`~mcore_agentic.sharding.config.ShardingConfig` — the ``sharding`` config group;
- :class:`~mcore_agentic.sharding.manager.ShardingManager` — ``with manager: <rollout>``;
- :class:`~mcore_agentic.sharding.transports.WeightVersion` / ``StaleWeightsError``;
- :class:`~mcore_agentic.sharding.exporter.StreamingExporter` — buckets of HF tensors;
- :func:`~mcore_agentic.sharding.transports.make_transport` — transports by name.
"""
