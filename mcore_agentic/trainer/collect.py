"""A step's rollout, scored, three ways: one round of the step's prompts; dynamic-sampling rounds (DAPO,
``algorithm.filter_groups``, see :mod:`.dynamic_sampling`); partial-rollout rounds over the leader's buffer of
requests in flight (``rollout.partial_rollout``, see :mod:`mcore_agentic.rollout.partial`).

:class:`RolloutCollector` owns what persists between steps for that: the training loader's current epoch
(every round draws from it, so its checkpointed position counts every prompt consumed) and the partial-rollout
buffer (a checkpoint part, ``rollout_buffer/``). Collective: every rank calls :meth:`RolloutCollector.collect`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.stats import max_over, sum_over
from mcore_agentic.rollout.driver import close_context, finish_batch, generate_sequences_sync, rollout_context, run_sync
from mcore_agentic.rollout.partial import RolloutBuffer
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.trainer import experience as exp
from mcore_agentic.trainer.dynamic_sampling import GroupPool, allocate, allocate_even, counts_tensor
from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.utils.timing import PhaseTimer

logger = logging.getLogger(__name__)

# Rollout seeds: request j of rollout group g (of G) at step k samples with base + (k * G + g) * SEED_STRIDE + j.
SEED_STRIDE = 100_003

Collected = tuple[Batch | None, list[Batch], list[int], dict[str, float]]
"""This rollout group's training rows (None off its leader, or when it trains none), every scored batch it
generated (for the step's statistics), the rows each rollout group trains, and the collection's metrics."""


class RolloutCollector:
    """Rolls out and scores each step's rows (see the module docstring)."""

    def __init__(self, c: Any, chat: ChatTokenizer, timer: PhaseTimer, pad_id: int):
        self.c = c
        self.cfg = c.cfg
        self.chat = chat
        self.timer = timer
        self.pad_id = pad_id
        self._batches: Any = iter(())
        self.buffer = RolloutBuffer() if self.cfg.rollout.partial_rollout.enable and c.placement.is_leader else None

    def start(self) -> None:
        """Begin drawing prompts where the loader stands (after a resume: its restored position)."""
        self._batches = iter(self.c.train_loader)

    def close(self) -> None:
        """Release the paused requests' tools and interactions."""
        if self.buffer is not None:
            run_sync(self.buffer.close(), self.c.engine)

    def collect(self, rows: list[dict[str, Any]], step: int) -> Collected:
        """The step's scored rollout (:data:`Collected`).

        Without ``algorithm.filter_groups`` one round of ``rows``; with it, rounds of fresh prompts until
        the step has ``data.train_batch_size`` informative groups (see :mod:`.dynamic_sampling`).
        """
        c, p = self.c, self.c.placement
        if self.cfg.rollout.partial_rollout.enable:
            return self.collect_partial(rows, step)
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            local = self.rollout_scored(rows, step, 0)
            per_group = [c.sizes.sequences_per_step // p.num_groups] * p.num_groups
            return local, [local] if local is not None else [], per_group, {}
        pool = GroupPool(fg.metric)
        generated: list[Batch] = []
        table = torch.zeros(p.num_groups, 2, dtype=torch.long)  # (informative, spare) groups per rollout group
        wanted = self.cfg.data.train_batch_size
        rounds = prompts = 0
        while True:
            if rounds:
                rows = self.next_prompts()
            local = self.rollout_scored(rows, step, rounds)
            rounds += 1
            prompts += len(rows)
            mine = torch.zeros_like(table)
            if local is not None:
                generated.append(local)
                mine = counts_tensor(p.num_groups, p.group_index, *pool.add(local))
            table += sum_over(dist.group.WORLD if dist.is_initialized() else None)(mine)
            if int(table[:, 0].sum()) >= wanted or (fg.max_num_gen_batches and rounds >= fg.max_num_gen_batches):
                break
        informative_groups = int(table[:, 0].sum())
        take = allocate(table[:, 0].tolist(), min(informative_groups, wanted))
        fill = allocate(table[:, 1].tolist(), wanted - sum(take))
        if sum(fill):
            logger.warning(
                "step %d: %d sampling rounds found %d of %d informative prompt groups; %d groups without reward "
                "variance fill the batch (raise algorithm.filter_groups.max_num_gen_batches)",
                step, rounds, informative_groups, wanted, sum(fill),
            )
        n = self.cfg.rollout.n
        local = None
        if p.is_leader:
            local = pool.take(take[p.group_index], fill[p.group_index], self.pad_id)
        metrics = {
            "rollout/sampling_rounds": float(rounds),
            "rollout/prompts_consumed": float(prompts),
            "rollout/filtered_groups": float(table[:, 1].sum()),
            "rollout/informative_groups": float(informative_groups),
            "rollout/filled_groups": float(sum(fill)),
        }
        return local, generated, [(a + b) * n for a, b in zip(take, fill)], metrics

    def collect_partial(self, rows: list[dict[str, Any]], step: int) -> Collected:
        """:meth:`collect` under ``rollout.partial_rollout``: start this step's prompts (and more while fewer than
        ``1 + over_sampling_batches`` batches of groups are in flight), run rounds of at most
        ``max_turns_per_step`` turns per request until ``data.train_batch_size`` groups are complete over the
        rollout groups, and train the oldest complete ones, shared evenly over the leaders (see
        :mod:`mcore_agentic.rollout.partial`)."""
        c, p = self.c, self.c.placement
        pr = self.cfg.rollout.partial_rollout
        wanted = self.cfg.data.train_batch_size
        world = sum_over(dist.group.WORLD if dist.is_initialized() else None)
        buf = self.buffer
        held = int(world(torch.tensor([len(buf) if buf is not None else 0]))[0])
        batches = [rows]
        while held + len(batches) * wanted < (1 + pr.over_sampling_batches) * wanted:
            batches.append(self.next_prompts())
        version = c.weight_sync.version.value
        ctx = None
        if buf is not None:
            ctx = rollout_context(c.engine, c.tools, c.interactions, self.cfg.rollout, self.chat, c.executor,
                                  weight_version=version, turn_budget=pr.max_turns_per_step)
            for k, b in enumerate(batches):
                buf.add(p.split_rows(b), dataclasses.replace(self.cfg.rollout, seed=self.rollout_seed(step, k)), ctx, step)
        rounds, resumed, stall = 0, 0, 0.0
        try:
            while True:
                mine = torch.zeros(p.num_groups, 2, dtype=torch.long)
                if buf is not None:
                    assert ctx is not None
                    report = run_sync(buf.run(ctx), c.engine)
                    resumed += report.resumed if rounds == 0 else 0  # paused in an earlier step, resumed now
                    stall = max(stall, report.stall_s)
                    mine[p.group_index] = torch.tensor([buf.complete_groups, buf.live_sessions])
                rounds += 1
                table = world(mine)
                if int(table[:, 0].sum()) >= wanted or int(table[:, 1].sum()) == 0:
                    break
        finally:
            if ctx is not None:
                close_context(ctx)
        take = allocate_even(table[:, 0].tolist(), wanted)
        local, oldest, stale = None, [], torch.zeros(2, dtype=torch.float64)
        if buf is not None and take[p.group_index]:
            requests = buf.take(take[p.group_index])
            for r in requests:
                sampled = [v for v in r.trajectory.response_versions if v >= 0]
                stale += torch.tensor([sum(v < version for v in sampled), len(sampled)], dtype=torch.float64)
            local = self.score(finish_batch(requests, self.cfg.rollout, self.chat), requests)
            local.info["rollout/event_loop_max_stall_s"] = stall
            oldest = [v for v in local["oldest_version"] if v >= 0]
        stale = world(stale)
        age = max_over(dist.group.WORLD if dist.is_initialized() else None)(
            torch.tensor([float(version - min(oldest)) if oldest else 0.0]))
        after = world(torch.tensor([float(len(buf)) if buf is not None else 0.0,
                                    float(buf.live_sessions) if buf is not None else 0.0, float(resumed)]))
        metrics = {
            "rollout/partial_rounds": float(rounds),
            "rollout/partial_prompts_started": float(len(batches) * wanted),
            "rollout/partial_resumed": float(after[2]),
            "rollout/partial_paused": float(after[1]),
            "rollout/partial_buffered_groups": float(after[0]),
            "rollout/oldest_token_age": float(age[0]),
            "rollout/stale_token_fraction": float(stale[0] / stale[1]) if stale[1] else 0.0,
        }
        n = self.cfg.rollout.n
        return local, [local] if local is not None else [], [t * n for t in take], metrics

    def score(self, batch: Batch, requests: list[Any]) -> Batch:
        """Score a leader's rollout batch (its requests' ``extra_info`` go to the reward function)."""
        c = self.c
        with self.timer.phase("reward"):
            return exp.score_rollout(
                batch, c.reward_fn, c.tokenizer, [r.extra_info for r in requests],
                overlong_buffer=self.cfg.reward.overlong_buffer, max_response_length=self.cfg.data.max_response_length,
            )

    def rollout_scored(self, rows: list[dict[str, Any]], step: int, round_: int) -> Batch | None:
        """This rollout group's share of ``rows``, rolled out with the seeds of (step, round) and scored; None off its leader."""
        c = self.c
        local_rows = c.placement.split_rows(rows)
        rollout_cfg = dataclasses.replace(self.cfg.rollout, seed=self.rollout_seed(step, round_))
        local = self.rollout(local_rows, rollout_cfg)
        if local is None:
            return None
        with self.timer.phase("reward"):
            extra = [r.get("extra_info") or {} for r in local_rows for _ in range(rollout_cfg.n)]
            return exp.score_rollout(
                local, c.reward_fn, c.tokenizer, extra,
                overlong_buffer=self.cfg.reward.overlong_buffer, max_response_length=self.cfg.data.max_response_length,
            )

    def next_prompts(self) -> list[dict[str, Any]]:
        """The loader's next batch of prompts (the next epoch's first at an epoch's end), the same on every rank."""
        for _ in range(2):
            rows = next(self._batches, None)
            if rows is not None:
                return rows
            self._batches = iter(self.c.train_loader)  # epoch boundary: the loader starts the next epoch
        raise RuntimeError("the training data loader yields no batches")

    def rollout(self, rows: list[dict[str, Any]], rollout_cfg: Any) -> Batch | None:
        """The group's rollout of ``rows`` on its leader (the rank holding the engine); None elsewhere."""
        c = self.c
        if not c.placement.is_leader:
            return None
        return generate_sequences_sync(
            rows, c.engine, c.tools, c.interactions, rollout_cfg, self.chat, c.executor
        )

    def rollout_seed(self, step: int, round_: int = 0) -> int:
        """Deterministic per step, sampling round and rollout group, so a resumed run samples what the
        uninterrupted one did. Round 0 keeps the stride layout; later (dynamic-sampling) rounds hash."""
        base = self.cfg.rollout.seed if self.cfg.rollout.seed is not None else self.cfg.seed
        p = self.c.placement
        if round_:
            return int(np.random.SeedSequence([base, step, p.group_index, round_]).generate_state(1)[0])
        return base + (step * p.num_groups + p.group_index) * SEED_STRIDE

    # -- checkpoints ------------------------------------------------------------------------------
    def _buffer_file(self, directory: Any) -> Any:
        return Path(directory) / f"group_{self.c.placement.group_index:05d}.pkl"

    def save_buffer(self, directory: Any) -> None:
        """Checkpoint writer: each rollout leader pickles its buffer (paused sessions with their tools' state)."""
        if self.buffer is None:
            return
        import pickle

        self._buffer_file(directory).write_bytes(pickle.dumps(self.buffer.snapshot(), protocol=pickle.HIGHEST_PROTOCOL))

    def load_buffer(self, directory: Any) -> None:
        """Checkpoint reader: the leader's buffer, its paused sessions' tool instances and interactions re-created."""
        if self.buffer is None:
            return
        import pickle

        path = self._buffer_file(directory)
        if not path.is_file():
            raise ConfigError(
                "rollout.partial_rollout.enable",
                f"{path} is missing: the checkpoint was written by another number of rollout groups or without "
                "partial rollouts; resume with the same layout",
            )
        c = self.c
        snap = pickle.loads(path.read_bytes())  # noqa: S301 -- the run's own checkpoint, verified by its manifest
        ctx = rollout_context(c.engine, c.tools, c.interactions, self.cfg.rollout, self.chat, c.executor)
        try:
            self.buffer = run_sync(RolloutBuffer.restore(snap, ctx), c.engine)
        finally:
            close_context(ctx)
