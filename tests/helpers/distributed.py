"""Spawn N gloo ranks on CPU (``cpu:gloo,cuda:nccl`` when each rank has a GPU) for a test and collect each rank's
return value.

Usage::

    def _body(rank: int, world_size: int, *args) -> Any:  # module-level, picklable
        ...
    results = run_distributed(_body, world_size=2, args=(...))

Each child initialises torch.distributed (gloo, a free loopback port), runs the
body, and sends its (picklable, CPU) return value back; an exception in any
rank fails the test with that rank's traceback.

The ranks are forked from one multiprocessing *forkserver* per test session that has imported torch,
megatron-core and transformers once (:data:`PRELOAD`), so a spawned group starts in well under a second
instead of paying those imports (~6 s) on every call. A forked rank is otherwise as fresh as a spawned one:
nothing ran in the server but the imports, and each rank gets the caller's current environment, working
directory and ``sys.path`` (multiprocessing sends the last two; :func:`_worker` applies the first).
On a GPU machine the ranks are spawned as before (:func:`_context`).

Ranks that do not each get a GPU of their own (more ranks than GPUs, or none) run with
``CUDA_VISIBLE_DEVICES=""`` from their start: CPU ranks on a one-GPU workstation must not all put their models on
``cuda:0`` (where gloo, the backend they then use, has no reduce-scatter).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers"]
"""Imported once, in the forkserver, before any rank is forked from it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, env: dict,
            on_gpus: bool, initialise: bool = True) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, as a spawned rank would have it (not the server's)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        from mcore_agentic.parallel import comm

        comm.enable_strict_from_env()  # the suite sets MCORE_AGENTIC_STRICT_COMM=1 (tests/conftest.py)
        # The launcher's mixed cpu:gloo,cuda:nccl where every rank has a GPU of its own (GPU tests), else gloo.
        if on_gpus:
            torch.cuda.set_device(rank)
        if initialise:  # else the body makes its own groups (a job split into trainer and rollout ranks)
            dist.init_process_group(comm.backend_for("cuda" if on_gpus else "cpu"), rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Pickled here, by value: the queue's own pickler would share a tensor's storage by a file descriptor that
        # the parent fetches from this process, which may have exited by then ("Connection reset by peer").
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            except Exception:  # noqa: BLE001
                pass
            dist.destroy_process_group()


def _context() -> Any:
    """The forkserver context, its server preloading :data:`PRELOAD` (set before the server first starts).

    Where torch sees a GPU, the spawn context instead: megatron-core imports TransformerEngine there, whose import
    initialises CUDA, and a process forked from one that did cannot use CUDA.
    """
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def ranks_on_gpus(world_size: int) -> bool:
    """Whether each of ``world_size`` ranks gets a GPU of its own (asked here, before any rank touches CUDA)."""
    return torch.cuda.is_available() and world_size <= torch.cuda.device_count()


@contextmanager
def _cuda_hidden(hide: bool) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=""`` in this process while ranks start (``hide``): a spawned rank's interpreter starts
    with this environment, before unpickling its body may import a CUDA user (TransformerEngine)."""
    if not hide:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 540.0, *,
                    initialise: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank. ``initialise``
    False: the body initialises torch.distributed itself (from the environment's ``RANK``/``WORLD_SIZE``)."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    on_gpus = ranks_on_gpus(world_size)
    env = dict(os.environ) if on_gpus else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env, on_gpus, initialise),
                    daemon=False)
        for r in range(world_size)
    ]
    with _cuda_hidden(not on_gpus):
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world_size):
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
            break
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
