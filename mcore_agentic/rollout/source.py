"""What produces trajectories: the :class:`TrajectorySource` protocol the feed's schedules drive, and its budget.

A source holds prompt groups in flight (``rollout.n`` sessions per prompt row) on a rollout leader. The schedules
(:mod:`mcore_agentic.feed.fresh_rounds`, :mod:`mcore_agentic.feed.partial_rounds`) drive any source alike:

1. :meth:`~TrajectorySource.start` a batch of rows under sampling settings (new groups, oldest last);
2. :meth:`~TrajectorySource.advance` every live session one round with the current weights: without a budget until
   each one ends (fresh rounds), or under a :class:`Budget` of assistant turns and sampled tokens per session, after
   which a session pauses (at a turn boundary, or mid-generation with the cut turn's ids kept) until the next round;
3. read :attr:`~TrajectorySource.groups` (oldest first): a group is complete when its sessions have all ended, and its
   :meth:`~SourceGroup.requests` are then its rows (an agent episode that forked trains several);
4. :meth:`~TrajectorySource.remove` the groups the step trains or sets aside;
5. :meth:`~TrajectorySource.snapshot` / :meth:`~TrajectorySource.restore` what is in flight through a checkpoint, and
   :meth:`~TrajectorySource.close` at the end of the run (paused sessions release what they hold).

The built-in agent loop (:class:`~mcore_agentic.rollout.partial.LoopSource`) and agent programs through the session
endpoint (:class:`~mcore_agentic.endpoint.source.AgentSource`) implement it. **To add a source** (an environment
server, remote rollout workers): one class with these members; the schedules, scoring, exchange and checkpoints take
it as they are (``Roller.new_source`` in ``feed/feed.py`` picks which one a run builds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.rollout.request import RolloutRequest


@dataclass(frozen=True)
class Budget:
    """What one round allows each live session (``rollout.partial_rollout``); None: no limit."""

    turns: int | None = None
    """Assistant turns (a cut turn going on counts as one)."""
    tokens: int | None = None
    """Sampled tokens, cutting a turn if need be."""
    max_staleness: int | None = None
    """A session whose first sampled token is this many weight versions old runs free of both, so it finishes."""


@dataclass
class RoundReport:
    """What one round did on a source."""

    resumed: int
    """Sessions that had paused before this round and ran again in it."""
    paused: int
    """Sessions paused at the end of the round."""
    paused_mid_turn: int
    """Of those, sessions the token budget paused inside an assistant turn."""
    prioritised: int
    """Sessions that ran free of the budgets (at the staleness bound)."""
    stall_s: float = 0.0
    """The rollout event loop's longest stall in the round (0 where nothing runs on it)."""


class Session(Protocol):
    """One sample's session on a source (a built-in loop request, an agent program's episode)."""

    @property
    def done(self) -> bool:
        """Whether it has ended."""

    @property
    def rows(self) -> list[RolloutRequest] | None:
        """Once ended: its ended requests, one per row it trains (an agent episode that forked trains several)."""


@dataclass
class SourceGroup:
    """One prompt's sessions on a source and the step that started them. ``scored`` and ``informative`` are the
    feed's (its scoring and filter), kept through checkpoints."""

    uid: str
    born: int
    sessions: list[Any]
    """:class:`Session`\\ s, in session order."""
    scored: Any = None
    """The group's rows once complete and scored (opaque here)."""
    informative: bool | None = None
    """Whether the feed's filter keeps the scored group (None: not scored yet)."""

    @property
    def complete(self) -> bool:
        """Whether every session of the group has ended."""
        return all(s.done for s in self.sessions)

    def requests(self) -> list[RolloutRequest]:
        """The group's ended requests, one per row it trains, in session order (complete groups only)."""
        return [r for s in self.sessions for r in (s.rows or [])]


class TrajectorySource(Protocol):
    """Whatever produces trajectories on a rollout leader (module docstring)."""

    groups: list[SourceGroup]
    """The groups in flight, oldest first."""

    def start(self, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig, born: int) -> None:
        """Start ``cfg.n`` sessions per row (seeded by ``cfg.seed``) as new groups."""

    def advance(self, weight_version: int, budget: Budget | None) -> RoundReport:
        """One round of every live session with the engine's current weights (``weight_version``): until each ends
        (``budget`` None) or pauses under ``budget``."""

    def remove(self, groups: Sequence[Any]) -> None:
        """Take complete ``groups`` out (the step trains them or sets them aside)."""

    @property
    def live_sessions(self) -> int:
        """Sessions that have not ended."""

    def in_flight_lengths(self) -> list[int]:
        """Response tokens so far of every live session (a lower bound on each one's final length)."""

    def paused_mid_turn(self) -> int:
        """Live sessions paused inside an assistant turn."""

    def snapshot(self) -> dict[str, Any]:
        """What is in flight, as picklable data (a checkpoint part)."""

    def restore(self, snap: Mapping[str, Any]) -> None:
        """Replace what is in flight by a :meth:`snapshot`'s (resume)."""

    def close(self) -> None:
        """Release whatever paused sessions hold; nothing is in flight after it."""


def roll_to_end(source: TrajectorySource, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig, *,
                weight_version: int) -> tuple[list[RolloutRequest], RoundReport]:
    """``rows`` rolled out to the end on a source holding nothing else: their requests in row order (a forked agent
    episode's rows together) and the round's report. The groups leave the source."""
    if source.groups:
        raise RuntimeError(f"roll_to_end on a source with {len(source.groups)} groups in flight")
    source.start(rows, cfg, 0)
    report = source.advance(weight_version, None)
    groups = list(source.groups)
    source.remove(groups)
    return [r for g in groups for r in g.requests()], report
