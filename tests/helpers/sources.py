"""A scripted trajectory source for tests: a new source is one class with the protocol's members, nothing else.

Each row's ``extra_info.script`` (token ids) is what each of its ``rollout.n`` sessions samples (odd sessions stop two
ids early), at most the round's
token budget at a time, every token recording the weight version of its round; a session ends when its script is
sampled. The feed's tests drive it through the real schedules, the feed and the step loop.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.rollout.driver import build_requests
from mcore_agentic.rollout.request import FinishReason, RequestState, RolloutRequest
from mcore_agentic.rollout.source import Budget, RoundReport, SourceGroup

PROMPT = [11, 12, 13]


@dataclass
class _Session:
    req: RolloutRequest
    script: list[int]

    @property
    def done(self) -> bool:
        return self.req.done

    @property
    def rows(self) -> list[RolloutRequest]:
        return [self.req]


class ScriptedSource:
    """Each row's ``extra_info.script`` (token ids) sampled by each of its sessions (odd ones stop two ids early, so a
group's responses differ), ``budget.tokens`` per round."""

    def __init__(self) -> None:
        self.groups: list[SourceGroup] = []

    def start(self, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig, born: int) -> None:
        by_uid: dict[str, list[_Session]] = {}
        for req in build_requests(rows, cfg):
            req.trajectory.set_prompt(list(PROMPT))
            j = int(req.request_id.rsplit("-", 1)[1])  # the session's index in its group: odd ones stop 2 ids early
            script = list(req.extra_info["script"])
            by_uid.setdefault(req.uid, []).append(_Session(req, script[: len(script) - 2 * (j % 2)]))
        self.groups += [SourceGroup(uid, born, sessions) for uid, sessions in by_uid.items()]

    def advance(self, weight_version: int, budget: Budget | None) -> RoundReport:
        live = [s for g in self.groups for s in g.sessions if not s.req.done]
        resumed = sum(s.req.state is RequestState.RUNNING for s in live)
        for s in live:
            if s.req.state is RequestState.PENDING:
                s.req.transition(RequestState.RUNNING)
            done = s.req.trajectory.response_len
            take = s.script[done: done + (budget.tokens if budget and budget.tokens else len(s.script))]
            s.req.trajectory.append(take, sampled=True, log_probs=[-0.5] * len(take), version=weight_version)
            if s.req.trajectory.response_len == len(s.script):
                s.req.messages.append({"role": "assistant", "content": "scripted"})
                s.req.complete(FinishReason.STOP)
        paused = [s for s in live if not s.req.done]
        return RoundReport(resumed=resumed, paused=len(paused), paused_mid_turn=len(paused), prioritised=0)

    def remove(self, groups: Sequence[SourceGroup]) -> None:
        ids = {id(g) for g in groups}
        self.groups = [g for g in self.groups if id(g) not in ids]

    @property
    def live_sessions(self) -> int:
        return sum(not s.req.done for g in self.groups for s in g.sessions)

    def in_flight_lengths(self) -> list[int]:
        return [s.req.trajectory.response_len for g in self.groups for s in g.sessions if not s.req.done]

    def paused_mid_turn(self) -> int:
        return self.live_sessions

    def snapshot(self) -> dict[str, Any]:
        return {"groups": copy.deepcopy(self.groups)}

    def restore(self, snap: Mapping[str, Any]) -> None:
        self.groups = copy.deepcopy(snap["groups"])

    def close(self) -> None:
        self.groups = []


ROWS = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "scripted",
         "extra_info": {"script": list(range(100 + i * 10, 106 + i * 10))}} for i in range(4)]
"""Four prompt rows, each with its six scripted ids."""
