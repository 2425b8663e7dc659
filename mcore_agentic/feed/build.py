"""The feed builds itself, from explicit arguments: its tools and interactions, the prompts (datasets and loader), the
rollout placement and each group leader's engine, the reward function, then :class:`~.feed.Roller` and
:class:`~.feed.Feed`.

The trainer hands it the feed's settings (:class:`~.feed.FeedSettings`, which the trainer makes from the config), the
data and reward groups, the tokenizer, the model spec (what the engine builds), the parallel layout, its phase timer
and the weight version the engine will hold. What the trainer needs back — the engine (the sharding manager feeds
it), the loader's epoch length (the LR schedule's steps) and what loading left out — it reads off the feed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from mcore_agentic.data.config import DataConfig
from mcore_agentic.feed.engine import build_rollout_engine
from mcore_agentic.feed.engine_guard import GuardedEngine
from mcore_agentic.feed.feed import Feed, Roller
from mcore_agentic.feed.settings import FeedSettings
from mcore_agentic.rewards.config import RewardConfig
from mcore_agentic.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)


def build_tools(rollout: RolloutConfig) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """``(tools, interactions, executor)`` of ``rollout.multi_turn`` (empty when multi-turn is off)."""
    from mcore_agentic.interactions.registry import load_interactions
    from mcore_agentic.tools.executor import make_executor
    from mcore_agentic.tools.registry import load_tools

    mt = rollout.multi_turn
    if not mt.enable:
        return {}, {}, None
    executor = make_executor(mt.tool_executor, max_workers=mt.tool_executor_workers)
    tools = load_tools(mt.tool_config_path, executor=executor) if mt.tool_config_path else {}
    interactions = load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {}
    return tools, interactions, executor


def build_datasets(data: DataConfig, rollout: RolloutConfig, tokenizer: Any, tools: dict[str, Any]) -> tuple[Any, Any]:
    """Training and validation datasets (over-long prompts filtered with the tools' schemas in the prompt)."""
    from mcore_agentic.data.dataset import load_datasets
    from mcore_agentic.tools.schema import openai_schemas

    schemas = openai_schemas(tools) if rollout.multi_turn.tool_schemas_in_prompt else None
    train, val = load_datasets(data, tokenizer=tokenizer, tool_schemas=schemas)
    for dataset in (train, val):
        line = dropped_line(dataset)
        if line is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(line)
    return train, val


def dropped_line(dataset: Any) -> str | None:
    """The dataset's line about prompts dropped for length (None for none, or for a plain list of rows)."""
    line = getattr(dataset, "dropped_line", None)
    return line() if line is not None else None


def build_feed(settings: FeedSettings, *, data: DataConfig, reward: RewardConfig, seed: int, layout: Any,
               tokenizer: Any, spec: Any, timer: Any, version: Callable[[], int], split: Any = None,
               links: Any = None) -> Feed:
    """The run's feed on this rank. Its rollout group's leader builds its engine here and releases it (so build the
    feed before any worker holds device memory: :func:`~.engine.build_rollout_engine`).

    ``split`` (:class:`~mcore_agentic.parallel.job.JobSplit`, separate placement): on a trainer rank, a feed whose
    rows come from the rollout ranks (the trainer's rank 0 reaches them over ``links``); on an engine's rank, the
    feed of its engine's share of the run, which :class:`~.rollout_service.RolloutService` drives."""
    from mcore_agentic.data.dataloader import make_train_loader
    from mcore_agentic.parallel.rollout_placement import RolloutPlacement
    from mcore_agentic.rewards import build_reward_fn

    rollout = settings.rollout
    tools, interactions, executor = build_tools(rollout)
    train_set, val_set = build_datasets(data, rollout, tokenizer, tools)
    loader = make_train_loader(train_set, data, seed)
    notes = [line for d in (train_set, val_set) if (line := dropped_line(d)) is not None]
    val_rows = list(val_set) if val_set is not None else []
    if split is not None and not split.is_rollout:
        return _trainer_feed(settings, layout=layout, loader=loader, val_rows=val_rows, tokenizer=tokenizer, spec=spec,
                             timer=timer, version=version, split=split, links=links, notes=notes, tools=tools,
                             executor=executor, reward=reward)
    if split is not None:  # an engine's rank: its share of every batch, seeded as colocated rollout group k of E
        placement = RolloutPlacement(split.engines, split.engine_index, 1)
        settings = dataclasses.replace(settings, prompts_per_step=settings.prompts_per_step // split.engines)
    else:
        placement = RolloutPlacement(layout.world_size, layout.rank, rollout.tensor_model_parallel_size)
    engine = build_rollout_engine(rollout, placement, spec, seed=seed)
    if split is not None:  # watched, so a dead engine is rebuilt under the sources (feed/engine_guard.py)
        engine = GuardedEngine(engine)
        version = lambda: int(engine.weight_version)  # noqa: E731 -- what this rank's engine loaded
    roller = Roller(settings, placement=placement, engine=engine, tools=tools, interactions=interactions,
                    executor=executor, tokenizer=tokenizer, reward_fn=build_reward_fn(reward), timer=timer,
                    version=version)
    feed = Feed(settings, roller, layout=layout, loader=loader, val_rows=val_rows,
                routing_shape=spec.routing_shape, data_notes=notes)
    feed.engine_factory = lambda: build_rollout_engine(rollout, placement, spec, seed=seed)
    return feed


def _trainer_feed(settings: FeedSettings, *, layout: Any, loader: Any, val_rows: list[dict[str, Any]], tokenizer: Any,
                  spec: Any, timer: Any, version: Callable[[], int], split: Any, links: Any, notes: list[str],
                  tools: dict[str, Any], executor: Any, reward: RewardConfig) -> Feed:
    """A trainer rank's feed under separate placement: one rollout group of the trainer's ranks led by rank 0, whose
    rows come streamed from the engines' ranks (:mod:`.streamed`). Its tools only show their schemas (an SFT
    warm-up's prompts); they run on the rollout ranks."""
    from mcore_agentic.feed.scoring import rollout_stats
    from mcore_agentic.feed.streamed import LinkEngine, Remote, StreamedRounds
    from mcore_agentic.parallel.rollout_placement import RolloutPlacement
    from mcore_agentic.rewards import build_reward_fn

    placement = RolloutPlacement(layout.world_size, layout.rank, layout.world_size)
    remote = Remote(links, split.engines) if layout.rank == 0 else None
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    schedule = StreamedRounds(remote, pad_id=pad_id, fields=settings.fields, routing_shape=spec.routing_shape,
                              empty_stats=lambda: rollout_stats([]), version=version,
                              max_staleness=settings.rollout.max_staleness)
    roller = Roller(settings, placement=placement, engine=LinkEngine(remote) if remote is not None else None,
                    tools=tools, interactions={}, executor=executor, tokenizer=tokenizer,
                    reward_fn=build_reward_fn(reward), timer=timer, version=version)
    return Feed(settings, roller, layout=layout, loader=loader, val_rows=val_rows, routing_shape=spec.routing_shape,
                data_notes=notes, schedule=schedule, remote=remote, streams=True)
