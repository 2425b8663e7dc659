"""Cross-rank order of a rollout's memory moves when one engine spans several ranks' GPUs (GPU review C1).

An SGLang engine of rollout TP=2 is launched by its group's leader (rank 0) and maps memory on rank 1's GPU too,
while rank 1's offload and reload are its own. Two gloo ranks, no GPU: the leader's engine and rank 1's actor are
stand-ins that sleep inside each call and record when it ran (``time.monotonic`` is one clock for every process).
The export stand-in is a host barrier, as the real export is a collective over all ranks, and the rollout's
stand-in ends with one, as the real one ends with the rounds table's.

Without the manager's barriers the leader wakes the engine's weights while rank 1 still offloads its optimizer
state, its KV cache while rank 1 still offloads its parameters, and rank 1 reloads while the engine still holds
its GPU.
"""

from __future__ import annotations

import time
from unittest import mock

from mcore_agentic.parallel import comm
from mcore_agentic.sharding import manager as manager_module
from mcore_agentic.sharding.config import ShardingConfig
from mcore_agentic.sharding.manager import ShardingManager
from mcore_agentic.sharding.transports import WeightVersion
from tests.helpers.distributed import run_distributed
from tests.unit.sharding.test_manager_order import _Actor, _Engine, _Exporter

ENGINE_PAUSE = 0.3
"""Seconds the leader's engine spends in each resume and release."""
ACTOR_PAUSE = 0.2
"""Seconds rank 1's actor spends in each offload and reload."""

Spans = dict[str, tuple[float, float]]


def _span(spans: Spans, name: str, pause: float) -> None:
    start = time.monotonic()
    time.sleep(pause)
    spans[name] = (start, time.monotonic())


class _CollectiveExporter(_Exporter):
    """The export stand-in, a collective over all ranks like the real one's gathers and broadcasts."""

    def buckets(self):
        comm.barrier()
        yield from super().buckets()


class _SlowActor(_Actor):
    def __init__(self, spans: Spans) -> None:
        super().__init__(log=[])
        self.spans = spans

    def offload_before_export(self) -> int:
        _span(self.spans, "offload grads+optimizer", ACTOR_PAUSE)
        return super().offload_before_export()

    def offload_after_export(self) -> int:
        _span(self.spans, "offload params", ACTOR_PAUSE)
        return super().offload_after_export()

    def reload(self) -> int:
        _span(self.spans, "reload", ACTOR_PAUSE)
        return super().reload()


class _SlowEngine(_Engine):
    def __init__(self, spans: Spans) -> None:
        super().__init__(log=[])
        self.spans = spans

    def resume_memory(self, tags=None) -> None:
        _span(self.spans, f"resume {'+'.join(tags)}", ENGINE_PAUSE)
        super().resume_memory(tags)

    def release_memory(self) -> None:
        _span(self.spans, "release", ENGINE_PAUSE)
        super().release_memory()


def _rollout_tp2(rank: int, world_size: int) -> Spans:
    """One ``with manager:`` around a rollout; rank 0 leads the rollout group of both ranks and holds the engine."""
    del world_size
    spans: Spans = {}
    version = WeightVersion()
    version.bump()
    with mock.patch.object(manager_module, "StreamingExporter", _CollectiveExporter):
        if rank == 0:
            manager = ShardingManager(_Actor(log=[]), _SlowEngine(spans), ShardingConfig(), version=version)
        else:
            manager = ShardingManager(_SlowActor(spans), None, ShardingConfig(), version=version)
    comm.barrier()  # both ranks start the step together
    with manager:
        comm.barrier()  # the rollout's last collective (the rounds table)
    return spans


def test_an_engine_spanning_two_ranks_is_ordered_against_their_offload_and_reload():
    leader, other = run_distributed(_rollout_tp2, world_size=2)
    assert set(leader) == {"resume weights", "resume kv_cache", "release"}
    assert set(other) == {"offload grads+optimizer", "offload params", "reload"}
    out_of_order = [
        what
        for what, first, then in [
            ("rank 1's grads and optimizer off before the engine's weights",
             other["offload grads+optimizer"], leader["resume weights"]),
            ("rank 1's parameters off before the engine's KV cache", other["offload params"], leader["resume kv_cache"]),
            ("the engine released before rank 1 reloads", leader["release"], other["reload"]),
        ]
        if not first[1] < then[0]
    ]
    assert out_of_order == [], f"{out_of_order}; leader {leader}, rank 1 {other}"
