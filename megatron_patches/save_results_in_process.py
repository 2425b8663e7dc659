"""Patch ``save_results_in_process``: a synchronous dist-checkpoint save collects its write results in-process.

Target: ``megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue``. Every
``dist_checkpointing.save`` writes through ``FileSystemWriterAsync``, whose forked writer processes report to
the saving process; the saving process then puts the gathered results on a module-level queue and reads them
back (``retrieve_write_results``). Megatron makes that queue, on the first save of each process, from a
``multiprocessing`` *spawn* context ``Manager()``: a fresh interpreter that re-imports the trainer's
``__main__``, and stays alive until the process exits. That costs 3.2 s on the first save of each rank (measured:
a 2-rank save of 1000 floats takes 3.24 s the first time, 0.07 s after, and 0.07 s the first time with this
patch) and holds one more process per rank for the job's life.

Our saves are synchronous (``mcore_agentic.trainer.model_checkpoint.save_worker``: no async request, no
persistent checkpoint worker), so the queue's producer and consumer are the same process and a thread-safe
``queue.Queue`` carries the results exactly. The forked writers still report through megatron's own
fork-context queues. This patch must go if megatron's asynchronous save (``async_save``) is ever used: there
the queue crosses to another process.

Reason: speed and one process fewer per rank; no change to what is written (the probe test compares the
files). Applied on GPU too (not ``cpu_only``).

Versions: megatron-core 0.16.x (run and tested on 0.16.1). Remove if megatron makes the queue lazily per save
or in-process for synchronous saves.
"""

from __future__ import annotations

import queue

from megatron_patches._base import Patch, PatchContext

_QUEUE: queue.Queue = queue.Queue()
"""The one results queue of this process (megatron's is one per process too)."""


def _in_process_results_queue() -> queue.Queue:
    return _QUEUE


def _install(ctx: PatchContext) -> None:
    writer = ctx.module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if writer is not None:
        ctx.swap(writer, "_get_write_results_queue", _in_process_results_queue)


PATCH = Patch(
    name="save_results_in_process",
    reason="a synchronous save's write results travel through a spawned multiprocessing Manager (3 s per rank)",
    install=_install,
    cpu_only=False,
)
