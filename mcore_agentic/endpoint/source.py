"""Agent programs as a trajectory source: each sample runs the program against its own endpoint session.

On a rollout leader, :class:`AgentSource` (a :class:`~mcore_agentic.rollout.source.TrajectorySource`) starts rows as
prompt groups: ``rollout.n`` episodes per row, each one run of the agent program (:mod:`.programs`) on the leader's
:class:`~.host.AgentHost` (the endpoint's server, the programs' loop), at most ``rollout.agent.max_concurrent`` of a
source at once (:class:`Slots`). A round without a budget waits for every program to end. Under partial rollouts
(``partial=True``) each session has a :class:`~.round_gate.RoundGate`: a round grants its turns and tokens, a
request past them waits (mid-generation if the tokens cut its turn) for the next round, and the round ends when
every program has ended or waits; the session records its engine calls, which a checkpoint keeps and a resumed
program replays (:meth:`AgentSource.restore`). When a program ends its session closes and becomes one training row,
like a built-in loop request:

* only the session's **main thread** counts (``Session.main_samples``): a harness's side calls (titles, checks,
  token counts: another thread) are served and counted (``agent/side_requests``), trained only with
  ``rollout.agent.side_requests=train`` (then as rows of their own, in session order);
* the row is the main thread's **last sample** (the one its latest turn extended): its exact ids, loss mask,
  log-probs and weight versions, and its messages. A forked session's earlier samples (a compaction, an edit, a
  retry) become rows of their own right before it (``rollout.agent.train_samples=all``, the default), in session
  order, with the episode's reward; their episode fields (``episode_id``, ``episode_sample``,
  ``episode_samples``, ``turn_offset``) let group statistics count the episode once and number its turns. With
  ``last`` they are only counted (``agent/untrained_samples``);
* the reward is the program's (plus what it posted to ``/reward``), or the reward function's over the row
  (``rollout.agent.reward``); a post that names a turn of the trained sample is also that turn's own reward
  (``algorithm.turn_rewards`` places it on the turn's last sampled token), on whichever sample holds the turn;
* the end-of-trajectory sanity check compares the row with a full render of its messages, as for the loop;
* a program that fails, times out, returns no reward, or never made a request fails its row (trains on nothing);
  but one that stops because the endpoint answered ``context_length_exceeded`` (the sample's budget is spent)
  leaves a row truncated by length, reward 0 plus what it posted, as the built-in loop ends such a request;
* when the program ends (returns, fails, times out, is killed) its session closes: the engine aborts the requests it
  left generating and the rollout waits for them (:func:`_settled`), so no request is live once the rollout ends
  (the sharding manager then releases the engine's memory). An aborted turn adds nothing: its sample ends at its
  last complete turn, and the row trains (or fails) by the program's outcome as any other. The rows are taken under
  the session's lock, which the endpoint holds while it changes a sample.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.data.batch import Batch
from mcore_agentic.endpoint.field_policy import metric_name
from mcore_agentic.endpoint.host import AgentHost
from mcore_agentic.endpoint.programs import (
    CommandRunner,
    ProgramOutcome,
    SessionAccess,
    run_program,
)
from mcore_agentic.endpoint.round_gate import RoundGate
from mcore_agentic.endpoint.samples import Sample, SessionSettings
from mcore_agentic.endpoint.session import Session
from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.rollout.driver import build_requests, finish_batch, run_sync
from mcore_agentic.rollout.request import FinishReason, RequestState, RolloutRequest, Trajectory
from mcore_agentic.rollout.source import Budget, RoundReport, SourceGroup, roll_to_end
from mcore_agentic.rollout.tokenization import ChatTokenizer, TokenizationPath
from mcore_agentic.rollout.tool_parser import get_tool_parser

logger = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "stop_sequence": FinishReason.STOP, "length": FinishReason.LENGTH,
           "tool_calls": FinishReason.TOOL_CALLS}


def session_settings(cfg: RolloutConfig, *, honor_client_sampling: bool = False) -> SessionSettings:
    """The sessions' budgets and sampling from the rollout config."""
    a = cfg.agent
    return SessionSettings(prompt_length=cfg.prompt_length, response_length=cfg.response_length,
                           max_model_len=cfg.effective_max_model_len, temperature=cfg.temperature, top_p=cfg.top_p,
                           top_k=cfg.top_k, honor_client_sampling=honor_client_sampling, max_messages=a.max_messages,
                           max_samples=a.max_samples_per_session,
                           tools_in_prompt=cfg.multi_turn.tool_schemas_in_prompt)


@dataclass
class Episode:
    """One sample's run of the agent program: the request it trains as, its session, and its rows once it ended."""

    req: RolloutRequest
    row: dict[str, Any]
    session: Session | None
    rows: list[RolloutRequest] | None = None
    """Set when the program has ended: its earlier samples' rows (``train_samples=all``), then ``req``."""
    running: bool = False
    """It holds one of the host's slots."""
    active_s: float = 0.0
    """Time the program ran outside a round's hold (what ``rollout.agent.timeout_s`` bounds under partial rollouts)."""
    future: concurrent.futures.Future[Any] | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.rows is not None


SNAPSHOT_VERSION = 1
QUIET_POLL_S = 0.02
"""How often a round looks whether every program has ended or waits for the next round."""
WATCHDOG_TICK_S = 0.5
"""How often a held program's timeout clock is read (its resolution)."""
HELD_WALL_LIMIT_S = 30 * 86400.0
"""Under partial rollouts a program's wall time includes the steps it waits through; its own limit is
``rollout.agent.timeout_s`` of time outside the waits (:attr:`Episode.active_s`), and this the wall clock's."""


class Slots:
    """The programs one source runs at once (``rollout.agent.max_concurrent``), on the programs' loop. A slot passes
    straight to the next waiting episode, which is marked running before anyone can look: a round never sees an
    episode between a slot's release and its next holder's start."""

    def __init__(self, size: int):
        self.free = size
        self.waiting: collections.deque[tuple[Episode, asyncio.Future[None]]] = collections.deque()

    @property
    def full(self) -> bool:
        return self.free == 0

    async def acquire(self, e: Episode) -> None:
        if self.free and not self.waiting:
            self.free -= 1
            e.running = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append((e, turn))
        await turn  # release() marks e running as it hands the slot over

    def release(self) -> None:
        while self.waiting:
            e, turn = self.waiting.popleft()
            if not turn.cancelled():
                e.running = True
                turn.set_result(None)
                return
        self.free += 1


class AgentSource:
    """Agent programs as a :class:`~mcore_agentic.rollout.source.TrajectorySource` (module docstring). ``host``: the
    leader's :class:`AgentHost`, shared by its sources (None: one of its own, closed with it). ``partial``: rounds
    may end with programs held (partial rollouts): their timeout counts only the time they run."""

    def __init__(self, cfg: RolloutConfig, engine: Any, chat: ChatTokenizer, *, version: Callable[[], int],
                 host: AgentHost | None = None, partial: bool = False):
        self.cfg = cfg
        self.engine = engine
        self.chat = chat
        self.version = version
        self.round_version = version()
        """The weight version of the round running (the last :meth:`advance`'s): what each sampled token records."""
        self.parser = get_tool_parser(cfg.multi_turn.format)
        self.own_host = host is None
        self.host = host if host is not None else AgentHost(cfg)
        self.partial = partial
        self.groups: list[SourceGroup] = []
        self.slots = Slots(cfg.agent.max_concurrent)
        """This source's (validation's source has its own: a partial source's held programs keep their slots)."""

    @property
    def url(self) -> str:
        return self.host.url

    @property
    def runner(self) -> CommandRunner | None:
        return self.host.runner

    # -- the source ------------------------------------------------------------------------------------------
    def start(self, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig, born: int) -> None:
        requests = build_requests(rows, cfg)  # ids, groups, seeds and data exactly as the built-in loop's
        by_uid: dict[str, list[Episode]] = {}
        for i, req in enumerate(requests):
            episode = Episode(req, dict(rows[i // cfg.n]), self._session(req))
            by_uid.setdefault(req.uid, []).append(episode)
            self._launch(episode)
        self.groups.extend(SourceGroup(uid, born, episodes) for uid, episodes in by_uid.items())

    def advance(self, weight_version: int, budget: Budget | None) -> RoundReport:
        self.round_version = weight_version
        live = [e for g in self.groups for e in g.sessions if not e.done]
        resumed = sum(e.session is not None and e.session.held for e in live)
        if budget is not None and not self.partial:
            raise ValueError("a round under a budget needs a source built with partial=True (its sessions' gates)")
        prioritised = 0
        for e in live:
            assert e.session is not None
            if e.session.gate is None:  # a fresh rollout: its calls run as they come
                continue
            first = e.session.first_version()
            free = budget is None or (budget.max_staleness is not None and first is not None
                                      and weight_version - first >= budget.max_staleness)
            prioritised += budget is not None and free
            e.session.gate.grant(None if free else budget.turns, None if free else budget.tokens)
        try:
            run_sync(self._quiet(live, budget=budget is not None), self.engine)
        finally:
            for e in live:
                if e.session is not None and e.session.gate is not None:
                    e.session.gate.shut()
        paused = [e for e in live if not e.done]
        return RoundReport(resumed=resumed, paused=len(paused), prioritised=prioritised,
                           paused_mid_turn=sum(e.session is not None and e.session.open_tokens > 0 for e in paused))

    def remove(self, groups: Sequence[SourceGroup]) -> None:
        ids = {id(g) for g in groups}
        self.groups = [g for g in self.groups if id(g) not in ids]

    @property
    def live_sessions(self) -> int:
        return sum(not e.done for g in self.groups for e in g.sessions)

    def in_flight_lengths(self) -> list[int]:
        """Per live episode: its longest sample's response so far."""
        out = []
        for e in (e for g in self.groups for e in g.sessions if not e.done):
            assert e.session is not None
            with e.session.lock:
                out.append(max((s.trajectory.response_len for s in e.session.samples), default=0)
                           + e.session.open_tokens)
        return out

    def paused_mid_turn(self) -> int:
        return sum(not e.done and e.session is not None and e.session.open_tokens > 0
                   for g in self.groups for e in g.sessions)

    def snapshot(self) -> dict[str, Any]:
        """Ended episodes as their rows; running ones as their request, row and the calls their session made (a
        resumed program runs again from its start, answered from them until it asks something else)."""
        groups = []
        for g in self.groups:
            episodes = []
            for e in g.sessions:
                if e.done:
                    episodes.append({"rows": e.rows})
                else:
                    assert e.session is not None
                    with e.session.lock:
                        tape = list(e.session.tape)
                    episodes.append({"req": e.req, "row": e.row, "tape": tape, "active_s": e.active_s})
            groups.append({"uid": g.uid, "born": g.born, "scored": g.scored, "informative": g.informative,
                           "episodes": episodes})
        return {"version": SNAPSHOT_VERSION, "groups": groups}

    def restore(self, snap: Mapping[str, Any]) -> None:
        """The snapshot's episodes: running ones start again and replay their calls; this returns when each has
        ended or waits for the next round."""
        if snap.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"agent source snapshot version {snap.get('version')!r}, expected {SNAPSHOT_VERSION}")
        self._end_all()
        live = []
        for g in snap["groups"]:
            episodes = []
            for item in g["episodes"]:
                if "rows" in item:
                    episodes.append(Episode(item["rows"][-1], {}, None, rows=list(item["rows"])))
                    continue
                req = copy.deepcopy(item["req"])
                episode = Episode(req, dict(item["row"]), self._session(req), active_s=float(item["active_s"]))
                assert episode.session is not None
                episode.session.replay.extend(item["tape"])
                episodes.append(episode)
                live.append(episode)
                self._launch(episode)
            self.groups.append(SourceGroup(g["uid"], g["born"], episodes, g.get("scored"), g.get("informative")))
        run_sync(self._quiet(live, budget=True), self.engine)

    def close(self) -> None:
        """End every program (:meth:`_end_all`); nothing is in flight after it. The host closes too when it is this
        source's own."""
        self._end_all()
        if self.own_host:
            self.host.close()

    def _end_all(self) -> None:
        """End every running program (its session closes: requests waiting for a round fail, the engine aborts what
        generates) and wait for it; one still waiting for a slot never starts."""
        live = [e for g in self.groups for e in g.sessions if not e.done]
        for e in live:
            if e.session is not None:
                e.session.close()
            if not e.running and e.future is not None:
                e.future.cancel()
        for e in live:
            if e.future is None or e.future.cancelled():
                continue
            try:
                e.future.result(timeout=60)
            except Exception as exc:  # noqa: BLE001 -- the run ends: say it and go on
                logger.warning("agent episode %s did not end cleanly: %r", e.req.request_id, exc)
        self.groups = []

    # -- a whole rollout, for code that needs no rounds (benches, tests) -----------------------------------------
    def roll_out(self, rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig) -> Batch:
        """Every row ``cfg.n`` times through the agent program, to the end; the collated batch (as the built-in
        loop's)."""
        started = time.perf_counter()
        requests, _ = roll_to_end(self, rows, cfg, weight_version=self.version())
        batch = finish_batch(requests, cfg, self.chat)
        batch.info["rollout/agent_seconds"] = time.perf_counter() - started
        return batch

    # -- one episode -----------------------------------------------------------------------------------------
    def _session(self, req: RolloutRequest) -> Session:
        session = Session(uuid.uuid4().hex, engine=self.engine, chat=self.chat, parser=self.parser,
                          settings=session_settings(self.cfg), version=lambda: self.round_version, seed=req.seed)
        if self.partial:  # its calls wait for rounds, and are recorded for a resume
            session.gate = RoundGate()
        return session

    def _launch(self, episode: Episode) -> None:
        episode.future = self.host.submit(self._episode(episode))

    def _quiet(self, live: Sequence[Episode], *, budget: bool) -> Any:
        """Wait until every episode of ``live`` has ended or (``budget``: a round under partial rollouts) waits for
        the next round, or for a slot none frees."""
        slots = self.slots

        def quiet(e: Episode) -> bool:
            if e.done:
                return True
            if not budget:
                return False
            if not e.running:
                return slots.full
            return e.session is not None and e.session.held

        async def wait() -> None:
            while not all(quiet(e) for e in live):
                await asyncio.sleep(QUIET_POLL_S)

        return wait()

    async def _episode(self, e: Episode) -> None:
        session = e.session
        assert session is not None
        req = e.req
        try:
            await self.slots.acquire(e)
            try:
                if session.closed:  # the source ended while the episode waited for its slot
                    raise RuntimeError("the rollout ended before the agent program started")
                base = f"{self.host.url}/sessions/{session.id}"
                access = SessionAccess(base_url=f"{base}/v1", anthropic_base_url=base, api_key=session.token,
                                       session_id=session.id)
                self.host.registry.add(session)
                if req.state is RequestState.PENDING:
                    req.transition(RequestState.RUNNING)
                try:
                    outcome = await self._run(e, access)
                finally:
                    session.close()  # aborts what the program left generating
                    self.host.registry.remove(session.id)
                await _settled(session)
            finally:
                self.slots.release()
            with session.lock:  # a turn the engine never answered (past _settled's bound) cannot change a sample now
                extras = self._finish(req, session, outcome)
        except BaseException as exc:  # noqa: BLE001 -- the source's own fault fails the sample, never the step
            if not req.done:
                req.fail(f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__)
            extras = []
        e.rows = [*extras, req]

    async def _run(self, e: Episode, access: SessionAccess) -> ProgramOutcome:
        """The program's run; under partial rollouts its timeout counts only the time it is not held for a round."""
        a, host = self.cfg.agent, self.host
        if not self.partial:
            return await run_program(host.entry, a.command, access, e.row, a.timeout_s, runner=host.runner)
        task = asyncio.ensure_future(run_program(host.entry, a.command, access, e.row, HELD_WALL_LIMIT_S,
                                                 runner=host.runner))
        session = e.session
        assert session is not None
        last = time.monotonic()
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCHDOG_TICK_S)
            now = time.monotonic()
            if not session.held:
                e.active_s += now - last
            last = now
            if done:
                return task.result()
            if e.active_s > a.timeout_s:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return ProgramOutcome(error=f"the agent program ran past rollout.agent.timeout_s={a.timeout_s:g} "
                                            "(its time held between rounds not counted)",
                                      error_type="TimeoutError", timed_out=True)

    def _finish(self, req: RolloutRequest, session: Session, outcome: ProgramOutcome) -> list[RolloutRequest]:
        """The session's last sample as ``req``'s row, rewarded, checked and ended; with ``train_samples=all`` its
        earlier samples as rows of their own (returned, in session order), sharing the episode's reward."""
        m = req.metrics
        sampled, side = session.main_samples(), session.side_samples()
        m.agent_samples = len(sampled)
        m.agent_fork_reasons = dict(Counter(s.fork_reason for s in sampled if s.fork_reason != "start"))
        m.agent_malformed_calls = sum(s.malformed_calls for s in sampled)
        m.agent_timed_out = int(outcome.timed_out)
        m.agent_side_requests = session.side_requests()
        m.agent_side_samples = len(side)
        m.agent_ignored_fields = _ignored_metrics(session.ignored)
        sample = max(sampled, key=lambda s: s.last_generation, default=None)
        if sample is None:
            req.trajectory = _prompt_only(self.chat, req.messages, self.cfg.prompt_length)
            if outcome.error is None:
                outcome = ProgramOutcome(error="the agent program made no request to its session",
                                         error_type="NoRequest")
        else:
            self._take(req, sample)
        if sample is not None and sample.exhausted and outcome.error is not None:
            # The endpoint ran out of budget and the program gave up on the 400: a truncated episode, not a fault
            # (the built-in loop ends such a request by length and trains it).
            outcome = ProgramOutcome(reward=0.0)
        reward = outcome.reward
        if session.reward is not None:
            reward = (reward or 0.0) + session.reward
        if outcome.error is None and self.cfg.agent.reward == "program" and reward is None:
            outcome = ProgramOutcome(error="the agent program returned no reward and posted none "
                                           "(rollout.agent.reward=program)", error_type="NoReward")
        if outcome.error is not None:
            m.agent_program_failed = 1
            req.fail(outcome.error, error_type=outcome.error_type, traceback=outcome.traceback)
            return []
        assert sample is not None
        earlier = [s for s in sampled if s is not sample] if self.cfg.agent.train_samples == "all" else []
        if self.cfg.agent.side_requests == "train":
            earlier = sorted([*earlier, *side], key=lambda s: s.index)
        extras = [self._extra(req, s) for s in earlier]
        for k, r in enumerate([*extras, req]):
            r.episode_id, r.episode_sample, r.episode_samples = req.request_id, k, len(extras) + 1
            if self.cfg.agent.reward == "program":
                r.source_reward = reward
        req.complete(_FINISH.get(sample.finish_reason or "stop", FinishReason.STOP))
        for r, s in zip(extras, earlier):
            r.complete(_FINISH.get(s.finish_reason or "stop", FinishReason.STOP))
        return extras

    def _extra(self, req: RolloutRequest, sample: Sample) -> RolloutRequest:
        """A row for an earlier sample of ``req``'s episode: the same prompt group, data and seed; its own tokens."""
        extra = RolloutRequest(request_id=f"{req.request_id}/{sample.index}", uid=req.uid, messages=[],
                               data_source=req.data_source, ground_truth=req.ground_truth,
                               tools_kwargs=req.tools_kwargs, interaction_kwargs=req.interaction_kwargs,
                               extra_info=req.extra_info, seed=req.seed)
        extra.transition(RequestState.RUNNING)
        self._take(extra, sample)
        extra.metrics.agent_extra_sample = 1
        return extra

    def _take(self, req: RolloutRequest, sample: Sample) -> None:
        req.trajectory = copy.deepcopy(sample.trajectory)
        req.messages = copy.deepcopy(sample.messages)
        # The episode's turn index of the sample's first turn: every turn the session sampled before it. Only read
        # when every sample trains (train_samples=all); under last the row's turns count from 0 whatever it says.
        req.turn_offset = max(sample.first_generation - 1, 0)
        length = req.trajectory.response_len
        req.turn_ends = [e if e < length else -1 for e in sample.turn_ends]
        req.turn_tool_rewards = [0.0] * sample.turns  # the program's tools are its own: their rewards are its posts
        req.turn_interaction_scores = [0.0] * sample.turns
        if self.cfg.agent.reward == "program":
            req.turn_source_rewards = list(sample.turn_rewards)
        m = req.metrics
        m.assistant_turns = sample.turns
        m.tool_calls = sum(len(msg.get("tool_calls") or []) for msg in sample.messages if msg.get("role") == "assistant")
        paths = sample.tokens.paths  # how each of the sample's environment deltas was tokenized
        m.tokenization_full_context = paths[TokenizationPath.FULL_CONTEXT]
        m.template_drift = paths[TokenizationPath.TWO_RENDERS]
        m.template_fallback = paths[TokenizationPath.BASE_FALLBACK]
        mode = self.cfg.multi_turn.tokenization_sanity_check_mode
        if mode != "disable":
            traj = req.trajectory
            diffs = self.chat.check_trajectory(
                traj.ids, traj.loss_mask, sample.messages, tools=sample.tools,
                num_prompt_messages=sample.num_prompt_messages, used_fallback=sample.tokens.used_fallback, mode=mode,
                truncated=sample.finish_reason == "length", ids_text=sample.tokens.text)
            m.sanity_check_mismatch = int(bool(diffs))
            req.sanity_check_diffs = diffs

async def _settled(session: Session, wait_s: float = 30.0) -> None:
    """Wait until no turn of a closed session is still being sampled: its samples are final, and none of its
    requests is live in the engine. The engine aborted them (:meth:`Session.close`), so this takes a step of the
    engine; ``wait_s`` bounds it for an engine that cannot abort (a scripted stand-in) or never answers."""
    deadline = time.monotonic() + wait_s
    while session.serving and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    if session.serving:
        logger.warning("session %s: a request is still generating %.0f s after the session closed and aborted it; "
                       "its row is taken as it stands (the engine may refuse to release its memory)",
                       session.id, wait_s)


def _ignored_metrics(ignored: Counter[str]) -> dict[str, int]:
    """Requests per ignored-field metric name (:func:`~.field_policy.metric_name`: unlisted names are ``other``)."""
    out: Counter[str] = Counter()
    for name, count in ignored.items():
        out[metric_name(name)] += count
    return dict(out)


def _prompt_only(chat: ChatTokenizer, messages: list[dict[str, Any]], prompt_length: int) -> Trajectory:
    """A row for a session that never sampled: its prompt (cut to fit), nothing to train."""
    traj = Trajectory()
    traj.set_prompt(chat.prompt_ids(messages, tools=None)[-prompt_length:])
    return traj
