"""vLLM's own prefix-cache counts for :meth:`VLLMEngine.prefix_cache_stats
<mcore_agentic.rollout.engines.vllm.VLLMEngine.prefix_cache_stats>`: a stat logger handed to ``LLMEngine``."""

from __future__ import annotations

import threading
from typing import Any


class PrefixCacheCounter:
    """vLLM's own prefix-cache statistics, summed over the engine's life.

    A per-engine stat logger (the interface of ``vllm.v1.metrics.loggers.StatLoggerBase``), handed to
    ``LLMEngine.from_engine_args(stat_loggers=[...])``: each ``LLMEngine.step`` records the step's
    ``SchedulerStats``, whose ``prefix_cache_stats`` the scheduler's KV cache manager filled as it admitted requests
    (``KVCacheManager.record_prefix_cache_stats``): ``queries``, the tokens it looked up (a new request's prompt),
    and ``hits``, those its prefix cache held. Re-admissions after a preemption come apart (``preempted_*``) and are
    left out, as vLLM's own hit-rate log leaves them. ``reset`` (the cache was dropped) resets nothing here: these are
    cumulative counts. Needs the engine's stat logging on (vLLM's default; ``disable_log_stats`` turns it off)."""

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0
        self.records = 0
        self._lock = threading.Lock()

    def factory(self, vllm_config: Any = None, engine_index: int = 0) -> PrefixCacheCounter:
        """vLLM's ``PerEngineStatLoggerFactory``: this counter for the (one) engine."""
        return self

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        stats = getattr(scheduler_stats, "prefix_cache_stats", None)
        if stats is None:
            return
        with self._lock:
            self.queries += int(stats.queries)
            self.hits += int(stats.hits)
            self.records += 1

    def read(self) -> tuple[int, int]:
        with self._lock:
            return self.queries, self.hits

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


__all__ = ["PrefixCacheCounter"]
