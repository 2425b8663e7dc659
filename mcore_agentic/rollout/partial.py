"""Partial rollouts: a rollout leader's prompt groups in flight across steps (``rollout.partial_rollout``).

A :class:`RolloutBuffer` holds, oldest first, every prompt group this leader has started and not yet
handed to training: each group's ``n`` sessions are ended (completed or failed), or paused (at a turn
boundary, or mid-turn with the cut turn's ids, log-probs and versions in its trajectory) with their tool
instances and interaction alive. :meth:`RolloutBuffer.run` gives every live session one round of at most
``turn_budget`` assistant turns and ``token_budget`` sampled tokens with the current engine and weights
(a session whose first token is ``max_staleness`` versions old runs free of both, so it finishes);
:meth:`RolloutBuffer.take` removes the oldest complete groups for training. Nothing is dropped here: a request
leaves the buffer in a trained group, in a group the feed's filter set aside (:meth:`RolloutBuffer.remove`,
counted there), or at :meth:`RolloutBuffer.close`, released.

:meth:`RolloutBuffer.snapshot` / :meth:`RolloutBuffer.restore` carry the buffer through a checkpoint
(pickled: rows' ``extra_info`` may hold any Python data); paused tools and interactions are re-created
with their instance ids and their exported state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from mcore_agentic.rollout.agent_loop import AgentContext, AgentSession
from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.rollout.loop_monitor import LoopStallMonitor
from mcore_agentic.rollout.request import RolloutRequest
from mcore_agentic.rollout.source import Budget, RoundReport, SourceGroup

SNAPSHOT_VERSION = 1


def first_version(req: RolloutRequest) -> int | None:
    """The weight version of the request's first sampled token (None before it sampled one)."""
    return next((v for v in req.trajectory.response_versions if v >= 0), None)


class RolloutBuffer:
    """A rollout leader's prompt groups in flight, oldest first (see the module docstring)."""

    def __init__(self) -> None:
        self.groups: list[SourceGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def complete_groups(self) -> int:
        return sum(g.complete for g in self.groups)

    @property
    def live_sessions(self) -> int:
        return sum(not s.req.done for g in self.groups for s in g.sessions)

    def add(self, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig, ctx: AgentContext, step: int) -> None:
        """Start ``cfg.n`` sessions per row (seeded by ``cfg.seed``, as a plain rollout would) as new groups."""
        from mcore_agentic.rollout.driver import build_requests

        by_uid: dict[str, list[AgentSession]] = {}
        for req in build_requests(rows, cfg):
            by_uid.setdefault(req.uid, []).append(AgentSession(req, ctx))
        self.groups.extend(SourceGroup(uid, step, sessions) for uid, sessions in by_uid.items())

    async def run(self, ctx: AgentContext, max_staleness: int | None = None) -> RoundReport:
        """One round: every live session continues (or starts) with ``ctx`` until it ends or pauses; one whose
        first sampled token is ``max_staleness`` or more versions behind ``ctx.weight_version`` runs to its end."""
        live = [s for g in self.groups for s in g.sessions if not s.req.done]
        resumed = sum(s.paused for s in live)
        for s in live:
            s.ctx = ctx
            first = first_version(s.req)
            s.budgeted = max_staleness is None or first is None or ctx.weight_version - first < max_staleness
        async with LoopStallMonitor() as monitor:
            await asyncio.gather(*(s.run() for s in live))
        return RoundReport(resumed=resumed, paused=sum(s.paused for s in live),
                           paused_mid_turn=sum(s.paused and s.open_turn > 0 for s in live),
                           prioritised=sum(not s.budgeted for s in live), stall_s=monitor.max_stall_s)

    def take(self, count: int) -> list[RolloutRequest]:
        """Remove the ``count`` oldest complete groups; their requests, group after group."""
        chosen = [g for g in self.groups if g.complete][:count]
        if len(chosen) < count:
            raise ValueError(f"{count} complete groups wanted, {len(chosen)} in the buffer")
        self.remove(chosen)
        return [s.req for g in chosen for s in g.sessions]

    def remove(self, groups: Sequence[SourceGroup]) -> None:
        """Remove ``groups`` (complete ones the feed trains or sets aside)."""
        ids = {id(g) for g in groups}
        self.groups = [g for g in self.groups if id(g) not in ids]

    def in_flight_lengths(self) -> list[int]:
        """Response tokens so far (sampled and environment) of every live session (a lower bound on each one's
        final length)."""
        return [s.req.trajectory.response_len for g in self.groups for s in g.sessions if not s.req.done]

    def oldest_born(self) -> int | None:
        return min((g.born for g in self.groups), default=None)

    # -- checkpoints ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The buffer as plain data: ended requests as they are, paused sessions by :meth:`AgentSession.snapshot`."""
        return {
            "version": SNAPSHOT_VERSION,
            "groups": [
                {"uid": g.uid, "born": g.born, "scored": g.scored, "informative": g.informative,
                 "sessions": [{"ended": s.req} if s.req.done else {"paused": s.snapshot()} for s in g.sessions]}
                for g in self.groups
            ],
        }

    @classmethod
    async def restore(cls, snap: Mapping[str, Any], ctx: AgentContext) -> RolloutBuffer:
        if snap.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"rollout buffer snapshot version {snap.get('version')!r}, expected {SNAPSHOT_VERSION}")
        buf = cls()
        for g in snap["groups"]:
            sessions = []
            for s in g["sessions"]:
                if "ended" in s:
                    session = AgentSession(s["ended"], ctx)
                else:
                    session = await AgentSession.restore(s["paused"], ctx)
                sessions.append(session)
            buf.groups.append(SourceGroup(g["uid"], g["born"], sessions, g.get("scored"), g.get("informative")))
        return buf

    async def close(self) -> None:
        """Release the tool instances and interactions of every paused session (the run ends)."""
        for g in self.groups:
            for s in g.sessions:
                if s.paused and not s.req.done:
                    await s.release()
        self.groups = []


class LoopSource:
    """The built-in agent loop as a :class:`~mcore_agentic.rollout.source.TrajectorySource`: a leader's engine, tools
    and interactions, its groups in flight in a :class:`RolloutBuffer`. ``cfg``: the rollout settings every round runs
    its sessions under (each start's own ``cfg`` seeds its requests)."""

    def __init__(self, engine: Any, tools: Mapping[str, Any] | None, interactions: Mapping[str, Any] | None,
                 cfg: RolloutConfig, chat: Any, executor: Any = None):
        self.engine, self.tools, self.interactions = engine, tools, interactions
        self.cfg, self.chat, self.executor = cfg, chat, executor
        self.buffer = RolloutBuffer()

    @property
    def groups(self) -> list[SourceGroup]:
        return self.buffer.groups

    @property
    def live_sessions(self) -> int:
        return self.buffer.live_sessions

    def _context(self, **extra: Any) -> AgentContext:
        from mcore_agentic.rollout.driver import rollout_context

        return rollout_context(self.engine, self.tools, self.interactions, self.cfg, self.chat, self.executor, **extra)

    def start(self, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig, born: int) -> None:
        from mcore_agentic.rollout.driver import close_context

        ctx = self._context()  # each round gives the sessions its own
        try:
            self.buffer.add(rows, cfg, ctx, born)
        finally:
            close_context(ctx)

    def advance(self, weight_version: int, budget: Budget | None) -> RoundReport:
        from mcore_agentic.rollout.driver import close_context, run_sync

        b = budget or Budget()
        ctx = self._context(weight_version=weight_version, turn_budget=b.turns, token_budget=b.tokens)
        try:
            return run_sync(self.buffer.run(ctx, b.max_staleness), self.engine)
        finally:
            close_context(ctx)

    def remove(self, groups: Sequence[SourceGroup]) -> None:
        self.buffer.remove(groups)

    def in_flight_lengths(self) -> list[int]:
        return self.buffer.in_flight_lengths()

    def paused_mid_turn(self) -> int:
        return sum(s.open_turn > 0 for g in self.groups for s in g.sessions if not s.req.done)

    def snapshot(self) -> dict[str, Any]:
        return self.buffer.snapshot()

    def restore(self, snap: Mapping[str, Any]) -> None:
        from mcore_agentic.rollout.driver import close_context, run_sync

        ctx = self._context()
        try:
            self.buffer = run_sync(RolloutBuffer.restore(snap, ctx), self.engine)
        finally:
            close_context(ctx)

    def close(self) -> None:
        from mcore_agentic.rollout.driver import run_sync

        if self.buffer.groups:
            run_sync(self.buffer.close(), self.engine)
