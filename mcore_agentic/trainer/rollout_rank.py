"""A rollout rank's run under separate placement (``rollout.placement=separate``): build its feed, serve the trainer.

The composition root of the job's other side (:mod:`mcore_agentic.parallel.job`): no Megatron, no worker. An engine's
rank builds the model spec and tokenizer as the trainer does, its feed (engine, tools, prompts, reward) and
serves until the trainer stops it (:class:`~mcore_agentic.feed.RolloutService`); a rollout group's other ranks
(an engine of rollout TP > 1 spans their GPUs) wait until the trainer's rank 0 marks the job done.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from mcore_agentic.parallel.job import job_store

logger = logging.getLogger(__name__)

DONE_KEY = "mcore_agentic/separate_placement_done"
MODEL_WAIT_S = 600.0


def wait_for_model(path: str | Path, timeout_s: float = MODEL_WAIT_S) -> None:
    """A missing embedded tiny model is written by the trainer's rank 0 (``ensure_model``): wait for it here."""
    config = Path(path) / "config.json"
    deadline = time.monotonic() + timeout_s
    while not config.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{config} did not appear within {timeout_s:.0f} s (the trainer's rank 0 writes it)")
        time.sleep(0.2)


def serve_rollout_rank(cfg: Any, split: Any, links: Any) -> None:
    """Run this rollout rank until the trainer says stop (every rollout rank calls it, SPMD)."""
    from mcore_agentic.feed import RolloutService

    defer_stop_signals(cfg.trainer.stop_signals)
    if not split.leads_engine:  # its GPU belongs to its group's engine; nothing to do until the job ends
        _wait_for_job_end(cfg)
        return
    wait_for_model(cfg.model.model_path)
    feed = build_rollout_feed(cfg, split, links)
    logger.info("rollout rank %d: engine %d of %d serving the trainer", split.rank, split.engine_index, split.engines)
    try:
        RolloutService(feed, links, max_staleness=cfg.rollout.max_staleness, rebuild=feed.engine_factory).serve()
    finally:
        feed.close()


def build_rollout_feed(cfg: Any, split: Any, links: Any) -> Any:
    """An engine's rank's feed: the model spec and tokenizer as the trainer builds them, its engine awake (it never
    sleeps on a rollout rank), its prompts drawn from the start."""
    from mcore_agentic.config.rules import validate
    from mcore_agentic.feed import build_feed
    from mcore_agentic.trainer.build import build_timer, build_tokenizer, feed_settings, model_spec

    sizes = validate(cfg, split.world_size)
    tokenizer = build_tokenizer(cfg.model.model_path)
    spec = model_spec(cfg, vocab_size=len(tokenizer))
    timer, _ = build_timer(cfg)
    feed = build_feed(feed_settings(cfg, sizes), data=cfg.data, reward=cfg.reward, seed=cfg.seed, layout=_Solo(),
                      tokenizer=tokenizer, spec=spec, timer=timer, version=lambda: 0, split=split, links=links)
    feed.engine.resume_memory()
    feed.start()
    return feed


def defer_stop_signals(names: list[str]) -> None:
    """A stop signal (``trainer.stop_signals``: Slurm's warning, torchrun's forward) is the trainer's to act on: it
    finishes its step, has this rank write its part of the checkpoint, then stops it. So the first one here only says
    so; a second one (after :data:`~.preemption.REPEAT_WINDOW_S`, as on the trainer's ranks) exits at once."""
    from mcore_agentic.trainer.preemption import REPEAT_WINDOW_S, parse_signals

    first: list[float] = []

    def handler(signum: int, frame: Any) -> None:
        del frame
        if first and time.monotonic() - first[0] > REPEAT_WINDOW_S:
            os._exit(128 + signum)
        if not first:
            first.append(time.monotonic())
            logger.warning("rollout rank: %s received; it serves on until the trainer, which saves at its step "
                           "boundary, stops it (a second signal exits at once)", signal.Signals(signum).name)

    for sig in parse_signals(names):
        signal.signal(sig, handler)


class _Solo:
    """The layout of a rollout rank's feed: a world of one (its rounds and statistics are its own)."""

    world_size = 1
    rank = 0
    data_parallel_size = 1


def mark_job_end() -> None:
    """The trainer's rank 0, at the end of a separate-placement run: release the rollout groups' waiting ranks."""
    store = job_store()
    if store is not None:
        store.set(DONE_KEY, "1")


def _wait_for_job_end(cfg: Any) -> None:
    store = job_store()
    if store is None:
        return
    while True:
        try:
            store.wait([DONE_KEY], timedelta(minutes=cfg.trainer.dist_timeout_minutes))
            return
        except Exception as exc:  # noqa: BLE001 -- a timeout: the run goes on; anything else: the job is gone
            if "timeout" not in str(exc).lower():
                return


__all__ = ["build_rollout_feed", "defer_stop_signals", "mark_job_end", "serve_rollout_rank", "wait_for_model"]
