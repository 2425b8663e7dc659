"""The feed: the rollout side of every step, up to the moment a DP replica holds its rows.

One :class:`Feed` per rank; every method is called by every rank (collective where it says so), and the feed
alone knows which rank leads a rollout group. A step, as the trainer calls it::

    with weight_sync:                       # the engine holds the actor's current weights
        rollout = feed.roll_out(step)       # prompts -> rounds of rollouts, scored, on each leader
    step_rows = feed.hand_off(rollout)      # this replica's rows (typed, tensors only) + the rollout metrics
    ...                                     # the trainer's algorithm on step_rows.rows
    feed.give_back(step_rows, batch)        # a dump step: the trainer's values go back to the leaders

The hand-off is :class:`StepRows`: :class:`ReplicaRows` (this DP replica's rows, in training order: what crossed
the wire, tensors only), a bound on the step's group ids (its row count: the group statistics' size) and the step's rollout
metrics, already reduced over the world. Its ``receipt`` is the feed's own (what a dump step needs to bring the
trainer's values back to the leaders).

Who holds what: a rollout leader holds its engine, tools, interactions, the step's scored rows (tensors and
per-row objects: messages, tool I/O, request metrics) and, under partial rollouts, its buffer of groups in
flight. Every rank holds the loader (each draws the same prompts, so the checkpointed position is one) and the
step's count tables. Only tensors cross ranks: the schedules' count tables (all-reduce), the rows' sizes
(all-gather), the rows (point-to-point to each replica's first rank, then a broadcast inside the replica:
:mod:`.distribute`) and, on dump steps, the trainer's per-token values back to the leaders.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.feed.distribute import (
    exchange_rows,
    filler_rows,
    gather_row_counts,
    gather_shapes,
    plan_step,
    return_rows,
    tag_episodes,
    tag_groups,
)
from mcore_agentic.feed.fields import RETURNED
from mcore_agentic.feed.fresh_rounds import FreshRounds
from mcore_agentic.feed.hand_off import ReplicaRows, StepRows
from mcore_agentic.feed.partial_rounds import PartialRounds
from mcore_agentic.feed.rollout_dump import DumpWriter, dump_rows
from mcore_agentic.feed.rounds import SEED_STRIDE, Prompts, Rollout, Schedule, allocation, rollout_seed, run_rounds
from mcore_agentic.feed.scoring import rollout_metrics, rollout_stats, score_rollout
from mcore_agentic.feed.settings import FeedSettings
from mcore_agentic.feed.turn_states import turn_state_tensor
from mcore_agentic.parallel import comm
from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.rollout.driver import finish_batch, mismatch_line
from mcore_agentic.rollout.engines.base import engine_shutdown, prefix_cache_stats
from mcore_agentic.rollout.failures import FailureReport, summarize_failures
from mcore_agentic.rollout.partial import LoopSource
from mcore_agentic.rollout.source import TrajectorySource, roll_to_end
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.tools.schema import openai_schemas
from mcore_agentic.utils.timing import PhaseTimer

logger = logging.getLogger(__name__)


@dataclass
class Roller:
    """A rollout group's means to roll out and score: the engine, tools and interactions on its leader."""

    settings: FeedSettings
    placement: Any
    engine: Any
    """None off a rollout group's leader."""
    tools: dict[str, Any]
    interactions: dict[str, Any]
    executor: Any
    tokenizer: Any
    reward_fn: Callable[..., Any]
    timer: PhaseTimer
    version: Callable[[], int]
    """The weight version the engine holds (the trainer's counter)."""
    between_rounds: Callable[[], None] = lambda: None
    """Called before each round (separate placement: a rollout rank loads the weights that arrived meanwhile)."""
    target_version: Callable[[int], int] | None = None
    """The weight version that will train a step's rows (None: the engine's, as when training follows at once);
    token ages and the staleness bound count from it."""

    def __post_init__(self) -> None:
        self.cfg = self.settings.rollout
        self.chat = ChatTokenizer(self.tokenizer)
        self.agent_host: Any = None
        """On a leader with ``rollout.agent`` set: what its agent-program sources share (the session endpoint's
        server, the programs' thread: :class:`~mcore_agentic.endpoint.host.AgentHost`; imported only then)."""
        if self.cfg.agent.enabled and self.leads:
            from mcore_agentic.endpoint.host import AgentHost

            self.agent_host = AgentHost(self.cfg)

    def new_source(self, cfg: RolloutConfig | None = None, *, partial: bool = False) -> TrajectorySource:
        """A trajectory source on this leader (:mod:`mcore_agentic.rollout.source`): agent programs through the session
        endpoint when ``rollout.agent`` is set, else the built-in loop with the leader's tools and interactions.
        ``cfg``: the settings its sessions run under (default: the run's); ``partial``: rounds may end with sessions
        paused (partial rollouts)."""
        cfg = cfg or self.cfg
        if self.agent_host is not None:
            from mcore_agentic.endpoint.source import AgentSource

            return AgentSource(cfg, self.engine, self.chat, version=self.version, host=self.agent_host,
                               partial=partial)
        return LoopSource(self.engine, self.tools, self.interactions, cfg, self.chat, self.executor)

    def roll(self, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig) -> Batch:
        """``rows`` rolled out ``cfg.n`` times each to the end on this leader, on a source of their own (a forked agent
        episode adds a row per earlier sample)."""
        source = self.new_source(cfg)
        try:
            requests, report = roll_to_end(source, rows, cfg, weight_version=self.version())
        finally:
            source.close()
        batch = finish_batch(requests, cfg, self.chat)
        batch.info["rollout/event_loop_max_stall_s"] = report.stall_s
        return batch

    def target(self, step: int) -> int:
        """The weight version that will train ``step``'s rows (:attr:`target_version`)."""
        return self.target_version(step) if self.target_version is not None else self.version()

    @property
    def leads(self) -> bool:
        """Whether this rank leads a rollout group (holds its engine, rolls out, scores, dumps)."""
        return bool(self.placement.is_leader)

    def sampling(self, step: int, batch: int) -> RolloutConfig:
        """The rollout settings of the step's ``batch``-th prompt batch on this group (its seeds)."""
        base = self.cfg.seed if self.cfg.seed is not None else self.settings.seed
        p = self.placement
        return dataclasses.replace(self.cfg, seed=rollout_seed(base, step, batch, p.group_index, p.num_groups))

    def score(self, batch: Batch, extra_infos: Sequence[dict[str, Any]]) -> Batch:
        """A training rollout scored (the over-long penalty included), timed as ``reward``."""
        s = self.settings
        with self.timer.phase("reward"):
            scored = score_rollout(batch, self.reward_fn, self.tokenizer, extra_infos,
                                   overlong_buffer=s.overlong_buffer, max_response_length=s.max_response_length,
                                   turn_rewards=s.wants("turn_rewards"))
            if s.wants("turn_states"):
                scored = scored.update({"turn_states": turn_state_tensor(scored, s.gigpo_state)})
            return scored


@dataclass
class Validation:
    """A validation's scored rollouts on this rank (none off the leaders)."""

    step: int
    scored: list[Batch]
    stats: Any = None
    """Its statistics where they came computed (from the rollout ranks under separate placement), else None."""


def make_schedule(settings: FeedSettings, roller: Roller, pad_id: int) -> Schedule:
    """The run's schedule: partial rounds under ``rollout.partial_rollout``, else fresh rounds."""
    pr = settings.rollout.partial_rollout
    if pr.enable:
        # Separate placement: one bound, rollout.max_staleness, counted from the version that will train the step.
        bound = settings.rollout.max_staleness if settings.rollout.separate else pr.max_staleness
        return PartialRounds(roller, settings.filter_metric, pad_id, max_turns_per_step=pr.max_turns_per_step,
                             over_sampling_batches=pr.over_sampling_batches, max_tokens_per_step=pr.max_tokens_per_step,
                             max_staleness=bound, prompts_per_batch=settings.prompts_per_step)
    return FreshRounds(roller, settings.filter_metric, pad_id)


class Feed:
    """The rollout side of a step on this rank (see the module docstring)."""

    def __init__(self, settings: FeedSettings, roller: Roller, *, layout: Any, loader: Any,
                 val_rows: list[dict[str, Any]], routing_shape: tuple[int, int] | None = None,
                 data_notes: Sequence[str] = (), schedule: Schedule | None = None, remote: Any = None,
                 streams: bool = False):
        self.settings = settings
        self.roller = roller
        self.data_notes = list(data_notes)
        """What loading the data left out (over-long prompts dropped), for the end-of-run summary."""
        self.layout = layout
        self.prompts = Prompts(loader)
        self.val_rows = val_rows
        if settings.wants("routed_experts") != (routing_shape is not None):
            raise ValueError(f"the rows carry routed_experts exactly when the model's routing shape is given, got "
                             f"routing_shape={routing_shape} and fields {sorted(settings.fields)}")
        self.routing_shape = routing_shape
        tok = roller.tokenizer
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.schedule = schedule if schedule is not None else make_schedule(settings, roller, self.pad_id)
        self.remote = remote
        """The trainer's rank 0 under separate placement: the rollout ranks (:class:`~.streamed.Remote`)."""
        self.streams = streams
        """This rank trains rows that rollout ranks generate (separate placement, a trainer rank)."""
        self.engine_factory: Callable[[], Any] | None = None
        """A new engine like this rank's (build_feed's; a rollout rank rebuilds a dead engine with it)."""
        d = settings.dumps
        self.dump_writer = DumpWriter(queue_size=d.queue_size, wait_s=d.wait_s) if d and roller.leads else None
        self.failures = FailureReport()  # this leader's, over the run (the end-of-run summary gathers them)
        self.last_failures = FailureReport()

    # -------------------------------------------------------------------------------- a training step
    def start(self) -> None:
        """Begin drawing prompts where the loader stands (after a resume: its restored position)."""
        self.prompts.start()

    def roll_out(self, step: int) -> Rollout:
        """The step's prompts rolled out and scored, in rounds until the step has its groups (collective; call it
        while the engine holds the current weights)."""
        s, r = self.settings, self.roller
        cache_before = prefix_cache_stats(r.engine)  # the engine's cumulative prompt / cached tokens (None: none)
        filtering = s.filter_metric is not None
        wanted = s.prompts_per_step
        first = self.prompts.next()
        result = run_rounds(
            self.schedule, first, step, wanted=wanted, num_groups=r.placement.num_groups,
            group_index=r.placement.group_index if r.leads else None, draw=self.prompts.next,
            max_batches=s.max_num_gen_batches if filtering else None,
        )
        take, fill = allocation(self.schedule, result.table, wanted)
        informative = int(result.table[:, 0].sum())
        if sum(fill):
            logger.warning(
                "step %d: %d sampling rounds found %d of %d informative prompt groups; %d groups without reward "
                "variance fill the batch (raise algorithm.filter_groups.max_num_gen_batches)",
                step, result.rounds, informative, wanted, sum(fill),
            )
        gi = r.placement.group_index
        rollout = self.schedule.take(take[gi] if r.leads else 0, fill[gi] if r.leads else 0, result.rounds)
        rollout.group_rows = [(a + b) * s.rollout.n for a, b in zip(take, fill)]
        metrics = dict(rollout.metrics)
        if filtering:  # groups found informative, set aside (trained only to fill), trained to fill
            metrics.update({
                "rollout/filtered_groups": float(result.table[:, 1].sum()),
                "rollout/informative_groups": float(informative),
                "rollout/filled_groups": float(sum(fill)),
            })
            metrics.update(self.schedule.round_metrics(result, len(first)))
        if r.leads:  # what failed, said once per step; a timing (under timing_s/): rank 0's group when logged
            self.report(rollout.generated, step, "train")
            metrics["timing_s/rollout_event_loop_max_stall"] = rollout.stall_s
        cache_after = prefix_cache_stats(r.engine)
        rollout.prefix_cache = cache_after - cache_before if cache_after is not None and cache_before is not None else None
        rollout.step, rollout.version, rollout.metrics = step, r.version(), metrics
        return rollout

    def hand_off(self, rollout: Rollout) -> StepRows:
        """Each replica's rows of the step, tensors only, and the step's rollout metrics (collective). The leaders'
        per-row objects never leave them."""
        s, r = self.settings, self.roller
        local, counts, real_rows = rollout.rows, list(rollout.group_rows), len(rollout.rows) if rollout.rows is not None else 0
        if s.episodes:  # agent episodes train every sample: a group's rows are known after its rollout
            counts = gather_row_counts(local, r.placement)
            fill = -sum(counts) % s.row_multiple
            holder = next((g for g, n in enumerate(counts) if n), 0)  # the first group with rows (a filter may
            counts[holder] += fill                                    # leave a group none) takes the fillers
            if fill and r.placement.group_index == holder and local is not None:
                local = Batch.concat([local, filler_rows(local, fill, self.pad_id)])
        if local is not None and rollout.stats is None:  # streamed rows came tagged from their rollout rank
            local = self.tagged(local, sum(counts[: r.placement.group_index]))
        stats = rollout.stats if rollout.stats is not None else rollout_stats(rollout.generated,
                                                                              prefix_cache=rollout.prefix_cache)
        stats = stats.reduce(world=True)
        shapes = gather_shapes(local, r.placement, counts)
        rows = sum(counts)  # the step's mini-batches stay as many; each holds its share of the rows
        plan = plan_step(
            shapes, self.layout.data_parallel_size,
            mini_batch_sizes=[rows * m // s.sequences_per_step for m in s.mini_batch_sizes],
            seed=s.plan_seed + rollout.step * SEED_STRIDE if s.plan_seed is not None else None,
        )
        batch = exchange_rows(local, plan, self.layout, self.pad_id, self.routing_shape, s.fields)
        metrics = {**rollout_metrics(stats), **rollout.metrics}
        if s.episodes:
            metrics["rollout/step_rows"] = float(rows)
        rollout.rows, rollout.plan, rollout.real_rows = local, plan, real_rows
        return StepRows(ReplicaRows.from_batch(batch), rows, metrics, rollout.step, receipt=rollout)

    def tagged(self, local: Batch, first_row: int) -> Batch:
        """A leader's rows with their step-wide ids from ``first_row`` (prompt groups, agent episodes) and each
        row's weight version as tensors (what the hand-off sends of the leader's per-row lists)."""
        local = tag_groups(local, first_row)
        if self.settings.episodes:
            local = tag_episodes(local, first_row)
        return local.update({"weight_version": torch.tensor(local["oldest_version"], dtype=torch.long)})

    def give_back(self, step_rows: StepRows, batch: Batch) -> dict[str, float]:
        """On a dump step, the trainer's per-token values of ``batch`` (this replica's rows after the experience)
        go back to the leaders, which queue their dumps (collective); ``dump/*`` metrics. Nothing otherwise."""
        d, step = self.settings.dumps, step_rows.step
        if d is None or step % d.freq:
            return {}
        receipt: Rollout = step_rows.receipt
        with self.roller.timer.phase("dump"):
            fields = [f for f in RETURNED if f in batch]
            local = receipt.rows
            returned = return_rows(batch, receipt.plan, self.layout, fields, len(local) if local is not None else None)
            if local is None or self.dump_writer is None:
                return {}
            if receipt.real_rows < len(local):  # filler rows are not trajectories
                local = local.index(list(range(receipt.real_rows)))
                returned = {k: v[: receipt.real_rows] for k, v in (returned or {}).items()}
            if self.remote is not None:  # the rows' objects are on the rollout ranks, which dump them
                self.remote.give_back(step, returned or {}, self.remote.rows)
                return {}
            self.dump([local], "train", step, receipt.version, returned)
            return {"dump/dropped_rows": float(self.dump_writer.dropped_rows), "dump/failed": float(self.dump_writer.failed)}

    # -------------------------------------------------------------------------------- validation
    def roll_out_validation(self, step: int) -> Validation:
        """Greedy single-sample rollout of each group's share of the validation prompts (call it while the engine
        holds the current weights). ``data.val_batch_size`` (prompts, over all rollout groups) bounds one rollout
        call; null rolls out each group's whole share at once."""
        r, s = self.roller, self.settings
        if self.streams:  # the rollout ranks validate the weights the sync just sent them
            return Validation(step, [], stats=self.remote.validate(step) if self.remote is not None else None)
        rows = r.placement.strided_rows(self.val_rows)
        val_cfg = dataclasses.replace(s.rollout, n=1, temperature=0.0, seed=s.seed)
        size = s.val_batch_size
        chunk = max(1, -(-size // r.placement.num_groups)) if size is not None else max(1, len(rows))
        parts = [rows[i : i + chunk] for i in range(0, len(rows), chunk)]
        batches = []
        if r.leads:
            batches = [r.roll(part, val_cfg) for part in parts]
        # A forked agent episode adds rows: each row's extra_info comes with it (the batch's meta).
        scored = [score_rollout(b, r.reward_fn, r.tokenizer,
                                b.meta.get("extra_info") or [row.get("extra_info") or {} for row in part],
                                turn_rewards=s.wants("turn_rewards"))
                  for b, part in zip(batches, parts)]
        return Validation(step, scored)

    def validation_metrics(self, val: Validation) -> dict[str, float]:
        """Mean reward, accuracy and tool calls of a validation, over every leader (collective); its failures
        reported and its rows dumped on the leaders."""
        if val.scored:
            self.report(val.scored, val.step, "val")
        if self.dump_writer is not None and val.scored:
            self.dump(val.scored, "val", val.step, self.roller.version())
        stats = val.stats if val.stats is not None else rollout_stats(val.scored)
        m = rollout_metrics(stats.reduce(world=True))
        return {f"val/{k}": m[k] for k in ("reward/mean", "reward/accuracy", "rollout/tool_calls_per_sample")}

    @property
    def has_validation(self) -> bool:
        return bool(self.val_rows)

    # -------------------------------------------------------------------------------- failures
    def report(self, batches: list[Batch], step: int, split: str) -> None:
        """On a rollout leader: this step's failed requests and failing tools (one warning each, with the first
        traceback) and its tokenization sanity-check mismatches (one line), added to the run's totals."""
        report = FailureReport()
        for b in batches:
            report.merge(summarize_failures(b.meta))
        report.log(logger, step, split)
        if split == "train":  # the stop rule and the run's totals count training rollouts (validation is logged)
            self.last_failures = report
            self.failures.merge(report)
        meta = {"request_metrics": [m for b in batches for m in b.meta.get("request_metrics", [])]}
        line = mismatch_line(meta)
        if line is not None:
            logger.warning("step %d (%s): %s", step, split, line)

    def failure_causes(self) -> str:
        """What this rank's rollouts of the last step say failed (its leader's tools and errors), for the stop line."""
        return "; ".join(self.last_failures.summary_lines()[:3])

    def failure_lines(self) -> list[str]:
        """The run's failure lines over every rollout leader (collective; identical on every rank)."""
        merged = FailureReport()
        for report in comm.all_gather_object(self.failures if self.roller.leads else None):
            if report is not None:
                merged.merge(report)
        return merged.summary_lines()

    # -------------------------------------------------------------------------------- dumps
    def dump(self, batches: list[Batch], split: str, step: int, version: int, returned: Any = None) -> None:
        """Queue a leader's dump. Best effort: only leaders run this, so an error here must not leave the
        other ranks waiting in the next collective; it is logged and counted (``dump/failed``)."""
        d = self.settings.dumps
        assert self.dump_writer is not None and d is not None
        group = self.roller.placement.group_index
        try:
            dump_rows(
                self.dump_writer, d.root, batches, split=split, step=step,
                group=group, weight_version=version, tokenizer=self.roller.tokenizer,
                fraction=d.fraction if split == "train" else 1.0, max_rows=d.max_rows,
                seed=(self.settings.seed + step) * 1009 + group, trainer_fields=returned,
            )
        except Exception as exc:  # noqa: BLE001 -- a diagnostic must not stop (or hang) training
            self.dump_writer.failed += 1
            logger.warning("trajectory dump of %s step %d (rollout group %d) failed: %r", split, step, group, exc)

    # -------------------------------------------------------------------------------- state
    def tool_schemas(self) -> list[dict] | None:
        """The tools' OpenAI schemas (what prompts show the model), or None without tools."""
        return openai_schemas(self.roller.tools)

    def loader_state(self) -> dict[str, Any]:
        return self.prompts.loader.state_dict()

    def load_loader_state(self, state: dict[str, Any]) -> None:
        self.prompts.loader.load_state_dict(state)

    def checkpoint_parts(self) -> tuple[dict[str, Callable[[Any], None]], dict[str, Callable[[Any], None]]]:
        """Checkpoint writers and readers of what the feed carries across steps (the schedule's: partial rollouts'
        groups in flight)."""
        return self.schedule.checkpoint_parts()

    @property
    def engine(self) -> Any:
        """This rank's rollout engine (None off a rollout group's leader): the sharding manager syncs it."""
        return self.roller.engine

    @property
    def batches_per_epoch(self) -> int:
        return len(self.prompts.loader)

    def close(self) -> None:
        """Finish queued dumps, release paused requests' tools, stop the tool executor and the engine."""
        try:
            try:
                if self.dump_writer is not None:
                    self.dump_writer.close()
            finally:
                self.schedule.close()
        finally:
            r = self.roller
            if r.agent_host is not None:
                r.agent_host.close()
            if r.executor is not None:
                r.executor.shutdown()
            # vLLM tears down its process groups on shutdown: do it while the trainer's world still exists
            engine_shutdown(r.engine)  # None on a rank that leads no rollout group
