"""Partial rounds (``rollout.partial_rollout``): prompt groups in flight across steps, in each leader's buffer.

At the start of a step every rank draws prompt batches while fewer than ``1 + over_sampling_batches`` batches
of groups are in flight over the leaders, and each leader starts its share on its trajectory source
(:mod:`mcore_agentic.rollout.source`: the built-in loop, or agent programs whose requests wait for the next round). Each round gives every live session at most
``max_turns_per_step`` assistant turns and ``max_tokens_per_step`` sampled tokens with the current weights (a
session whose first token is ``max_staleness`` versions old runs free of both, so it finishes: long requests are
prioritised, never dropped); a group whose ``n`` sessions have all ended is
scored at once and, under ``algorithm.filter_groups``, sorted (informative or spare). The step trains the oldest
kept groups, shared evenly over the leaders (:func:`~mcore_agentic.feed.dynamic_sampling.allocate_even`), and
spares only to fill a step the rounds could not fill. Kept groups not trained stay for the next step, scored;
spares not trained leave with the step. Every started group is trained once, still buffered, or set aside:
``started = trained + buffered + (filtered - filled)`` over a run.

Metrics that would show a length bias: the response lengths of the rows trained this step
(``rollout/partial_trained_length_{mean,max}``) next to those of the sessions left in flight so far
(``rollout/partial_in_flight_length_{mean,max}``, a lower bound on their final lengths).

With a filter the rounds may draw more prompts when every session has ended and the step still lacks groups
(``algorithm.filter_groups.max_num_gen_batches`` counts the batches a step draws, its top-up included).

What is in flight (paused sessions with their tools' state, or agent programs with the calls they made; complete
groups with their scores) is a checkpoint part (``rollout_buffer/``, one file per rollout group: the source's
snapshot and the batches drawn but not started).

On a rollout rank ahead of the trainer (separate placement, weights already ``max_staleness`` behind the version that
will train the step) every session runs free and the step starts no more groups than it takes: anything left for a
later step would be trained past the bound. The batches it does not start wait, drawn, for a later step.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.data.batch import concat_rollouts
from mcore_agentic.feed.dynamic_sampling import informative
from mcore_agentic.feed.rounds import Rollout, RoundsResult, Rows, allocate_even
from mcore_agentic.parallel.stats import max_over, sum_over
from mcore_agentic.rollout.driver import finish_batch
from mcore_agentic.rollout.source import Budget, TrajectorySource
from mcore_agentic.utils.errors import ConfigError


def _world() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


class PartialRounds:
    """The :class:`~mcore_agentic.feed.rounds.Schedule` of partial rollouts (see the module docstring)."""

    def __init__(self, roller: Any, metric: str | None, pad_id: int, *, max_turns_per_step: int | None,
                 over_sampling_batches: int, prompts_per_batch: int, max_tokens_per_step: int | None = None,
                 max_staleness: int | None = None):
        self.roller = roller
        self.metric = metric
        self.pad_id = pad_id
        self.max_turns_per_step = max_turns_per_step
        self.max_tokens_per_step = max_tokens_per_step
        self.max_staleness = max_staleness
        self.over_sampling_batches = over_sampling_batches
        self.prompts_per_batch = prompts_per_batch
        self.buffer: TrajectorySource | None = roller.new_source(partial=True) if roller.leads else None
        """This leader's trajectory source: its groups in flight across steps (None off the leaders)."""
        self.deferred: list[tuple[Rows, int, int]] = []
        """Prompt batches drawn but not started, with their step and batch index (their seeds): a rollout rank ahead
        of the trainer starts no more than its step trains (separate placement)."""
        self._reset()

    def _reset(self) -> None:
        self.version = 0
        """The weights the engine holds (what the round's tokens are stamped with)."""
        self.target = 0
        """The version that will train the step (the engine's in a colocated run; ahead of it on a rollout rank,
        which generates while the trainer trains): token ages and the staleness bound count from it."""
        self.rounds = self.resumed = self.started = self.prioritised = 0
        self.stall_s = 0.0

    # -- the schedule --------------------------------------------------------------------------------
    def begin(self, rows: Rows, step: int, draw: Callable[[], Rows]) -> int:
        self._reset()
        held = int(sum_over(_world())(torch.tensor([len(self.buffer.groups) if self.buffer is not None else 0]))[0])
        wanted = self.prompts_per_batch
        self.version, self.target = self.roller.version(), self.roller.target(step)
        queue = [*self.deferred, (rows, step, 0)]
        self.deferred = []
        if self.max_staleness is not None and self.target - self.version >= self.max_staleness:
            # Weights already max_staleness behind the step's (a rollout rank ahead of the trainer): whatever starts
            # now must be trained in this step, so start no more than it takes (held groups first, then the batches
            # drawn earliest); the rest wait, drawn but not started, for a step that needs them.
            while queue and held < wanted:
                self.start(*queue.pop(0))
                held += wanted
            self.deferred = queue
            return 1
        held += (len(queue) - 1) * wanted  # batches drawn in earlier steps start now, with the step's own
        drawn = 1
        while held + drawn * wanted < (1 + self.over_sampling_batches) * wanted:
            queue.append((draw(), step, drawn))
            drawn += 1
        for batch in queue:
            self.start(*batch)
        return drawn

    def start(self, rows: Rows, step: int, batch: int) -> None:
        self.started += len(rows)
        if self.buffer is not None:
            self.buffer.start(self.roller.placement.split_rows(rows), self.roller.sampling(step, batch), step)

    def round(self, step: int) -> tuple[int, int, int]:
        buf = self.buffer
        if buf is None:
            return 0, 0, 0
        self.roller.between_rounds()  # separate placement: new weights load here, between two rounds
        self.version, self.target = self.roller.version(), self.roller.target(step)
        # A session runs free once its first token is max_staleness behind the version that will train it. On a
        # rollout rank whose weights are already that far behind the step's (separate placement), every session
        # runs free: one that started now and paused would be trained a step later, past the bound.
        bound = None if self.max_staleness is None else self.max_staleness - (self.target - self.version)
        budget = (Budget(self.max_turns_per_step, self.max_tokens_per_step, bound) if bound is None or bound > 0
                  else Budget())
        report = buf.advance(self.version, budget)
        self.prioritised += report.prioritised
        if self.rounds == 0:
            self.resumed = report.resumed  # paused in an earlier step, resumed now
        self.rounds += 1
        self.stall_s = max(self.stall_s, report.stall_s)
        self._score_complete(buf)
        kept = sum(g.complete and bool(g.informative) for g in buf.groups)
        spare = sum(g.complete and g.informative is False for g in buf.groups)
        return kept, spare, buf.live_sessions

    def _score_complete(self, buf: TrajectorySource) -> None:
        """Score the groups that completed since the last round (one batch), and sort them under the filter."""
        new = [g for g in buf.groups if g.complete and g.scored is None]
        if not new:
            return
        per_group = [g.requests() for g in new]
        requests = [q for group in per_group for q in group]
        r = self.roller
        scored = r.score(finish_batch(requests, r.cfg, r.chat), [q.extra_info for q in requests])
        at = 0
        for g, group in zip(new, per_group):
            g.scored = scored.index(list(range(at, at + len(group))))
            at += len(group)
            g.informative = self.metric is None or informative(g.scored, self.metric)[0]

    def allocate(self, available: Sequence[int], wanted: int) -> list[int]:
        return allocate_even(available, wanted)

    def take(self, kept: int, spare: int, rounds: int) -> Rollout:
        rows, generated, stale, oldest = None, [], torch.zeros(2, dtype=torch.float64), []
        lengths = torch.zeros(4, dtype=torch.float64)  # trained rows: count, tokens; in flight: count, tokens
        longest = torch.zeros(2, dtype=torch.float64)
        set_aside: list[Any] = []
        buf = self.buffer
        if buf is not None:
            # The groups the rounds scored (an agent program may end between rounds: its group waits for the next)
            complete = [g for g in buf.groups if g.complete and g.scored is not None]
            chosen = ([g for g in complete if g.informative][:kept]
                      + [g for g in complete if g.informative is False][:spare])
            taken = {id(g) for g in chosen}
            set_aside = [g for g in complete if g.informative is False and id(g) not in taken]
            buf.remove(chosen + set_aside)
            if chosen:
                rows = concat_rollouts([g.scored for g in chosen], self.pad_id)
                trained = [q for g in chosen for q in g.requests()]
                rows = rows.update({"token_ages": self._token_ages(rows, trained)})
                for q in trained:
                    sampled = [v for v in q.trajectory.response_versions if v >= 0]
                    stale += torch.tensor([sum(v < self.target for v in sampled), len(sampled)], dtype=torch.float64)
                    n = q.trajectory.response_len
                    lengths[:2] += torch.tensor([1.0, n], dtype=torch.float64)
                    longest[0] = max(float(longest[0]), n)
                oldest = [v for v in rows["oldest_version"] if v >= 0]
                generated.append(rows)
            generated += [g.scored for g in set_aside]
        if buf is not None:
            flying = buf.in_flight_lengths()
            lengths[2:] = torch.tensor([len(flying), sum(flying)], dtype=torch.float64)
            longest[1] = max(flying, default=0)
        world = sum_over(_world())
        stale = world(stale)
        lengths, longest = world(lengths), max_over(_world())(longest)
        mid_turn = 0 if buf is None else buf.paused_mid_turn()
        age = max_over(_world())(torch.tensor([float(self.target - min(oldest)) if oldest else 0.0]))
        after = world(torch.tensor([float(len(buf.groups)) if buf is not None else 0.0,
                                    float(buf.live_sessions) if buf is not None else 0.0, float(self.resumed),
                                    float(mid_turn), float(self.prioritised)]))
        metrics = {
            "rollout/partial_rounds": float(rounds),
            "rollout/partial_prompts_started": float(self.started),
            "rollout/partial_resumed": float(after[2]),
            "rollout/partial_paused": float(after[1]),
            "rollout/partial_paused_mid_turn": float(after[3]),
            "rollout/partial_prioritised": float(after[4]),
            "rollout/partial_trained_length_mean": float(lengths[1] / lengths[0]) if lengths[0] else 0.0,
            "rollout/partial_trained_length_max": float(longest[0]),
            "rollout/partial_in_flight_length_mean": float(lengths[3] / lengths[2]) if lengths[2] else 0.0,
            "rollout/partial_in_flight_length_max": float(longest[1]),
            "rollout/partial_buffered_groups": float(after[0]),
            "rollout/oldest_token_age": float(age[0]),
            "rollout/stale_token_fraction": float(stale[0] / stale[1]) if stale[1] else 0.0,
        }
        return Rollout(rows=rows, generated=generated, group_rows=[], metrics=metrics, stall_s=self.stall_s)

    def _token_ages(self, rows: Any, requests: Sequence[Any]) -> torch.Tensor:
        """``[B, R]`` long: how many weight versions behind the step each sampled token is (0 elsewhere): what
        the rollout correction's metrics by token age read (``rollout_corr/age_*``)."""
        if len(requests) != len(rows):
            raise RuntimeError(f"{len(rows)} rows from {len(requests)} buffered requests")
        ages = torch.zeros(rows["responses"].shape, dtype=torch.long)
        for i, req in enumerate(requests):
            versions = torch.tensor(req.trajectory.response_versions[: ages.shape[1]], dtype=torch.long)
            ages[i, : len(versions)] = torch.where(versions >= 0, self.target - versions, 0)
        return ages

    def round_metrics(self, result: RoundsResult, batch_size: int) -> dict[str, float]:
        return {}  # its rounds are not prompt batches: rollout/partial_* say what they did

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint_parts(self) -> tuple[dict[str, Callable[[Any], None]], dict[str, Callable[[Any], None]]]:
        """What is in flight, one file per rollout group under ``rollout_buffer/``."""
        return {"rollout_buffer": self.save}, {"rollout_buffer": self.load}

    def _file(self, directory: Any) -> Path:
        return Path(directory) / f"group_{self.roller.placement.group_index:05d}.pkl"

    def save(self, directory: Any) -> None:
        """Checkpoint writer: each rollout leader pickles its source's snapshot (what is in flight)."""
        if self.buffer is not None:
            state = {"source": self.buffer.snapshot(), "deferred": self.deferred}
            self._file(directory).write_bytes(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))

    def load(self, directory: Any) -> None:
        """Checkpoint reader: the leader's buffer, its paused sessions' tool instances and interactions re-created."""
        if self.buffer is None:
            return
        path = self._file(directory)
        if not path.is_file():
            raise ConfigError(
                "rollout.partial_rollout.enable",
                f"{path} is missing: the checkpoint was written by another number of rollout groups or without "
                "partial rollouts; resume with the same layout",
            )
        state = pickle.loads(path.read_bytes())  # noqa: S301 -- the run's own checkpoint, verified by its manifest
        if set(state) != {"source", "deferred"}:  # written before deferred batches: the source's snapshot alone
            state = {"source": state, "deferred": []}
        self.buffer.restore(state["source"])
        self.deferred = state["deferred"]

    def close(self) -> None:
        """Release what is in flight (paused requests' tools and interactions, running agent programs)."""
        if self.buffer is not None:
            self.buffer.close()
