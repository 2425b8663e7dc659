"""One conversation's rollout state: the request state machine and its typed trajectory.

A :class:`RolloutRequest` moves ``pending -> running -> (tool_calling | interacting
-> running)* -> completed``, or to ``failed`` from any live state. A failed request, and
one the engine aborted, keeps its row but trains on nothing (its loss mask is all 0). Illegal moves
raise :class:`IllegalTransition` (they are bugs in the loop, not model errors).
The :class:`Trajectory` holds the token ids in sequence order with a parallel loss
mask, rollout logprobs and sampling weight versions (and, for a mixture-of-experts engine asked for them,
the experts its routers chose per token); :meth:`Trajectory.append` is the only way to grow it, so
the lists never drift apart, and :meth:`Trajectory.truncate` cuts them together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np


class RequestState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    INTERACTING = "interacting"
    COMPLETED = "completed"
    FAILED = "failed"


class FinishReason(StrEnum):
    """Why a trajectory ended (its last turn)."""

    STOP = "stop"  # the model ended its turn without tool calls (or the interaction ended it)
    LENGTH = "length"  # a length budget was hit (response_length, max_model_len, engine max_new_tokens)
    TOOL_CALLS = "tool_calls"  # max_assistant_turns reached while the model still asked for tools
    ABORTED = "aborted"  # the engine aborted, or the request failed


_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.PENDING: frozenset({RequestState.RUNNING, RequestState.FAILED}),
    RequestState.RUNNING: frozenset(
        {RequestState.TOOL_CALLING, RequestState.INTERACTING, RequestState.COMPLETED, RequestState.FAILED}
    ),
    RequestState.TOOL_CALLING: frozenset({RequestState.RUNNING, RequestState.COMPLETED, RequestState.FAILED}),
    RequestState.INTERACTING: frozenset({RequestState.RUNNING, RequestState.COMPLETED, RequestState.FAILED}),
    RequestState.COMPLETED: frozenset(),
    RequestState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change the machine does not allow (a bug in the caller)."""


@dataclass
class RequestMetrics:
    """Per-request counters; exported as a plain dict in the batch's ``request_metrics``."""

    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    sanity_check_mismatch: int = 0
    """1 when the trajectory differs from the template's render of its messages (see tokenization)."""
    template_fallback: int = 0
    """Env deltas computed with the fixed base conversation because the template rewrote history."""
    template_drift: int = 0
    """Env deltas after a sampled turn the template re-renders differently (two renders; the check reports it)."""
    tokenization_full_context: int = 0
    """Env deltas computed from full-history renders because the template failed the context probe."""
    prompt_tokens: int = 0
    response_tokens: int = 0
    generate_seconds: float = 0.0
    tool_seconds: float = 0.0
    latency_seconds: float = 0.0
    mid_turn_pauses: int = 0
    """Partial rollouts: times the token budget cut one of the request's assistant turns (it went on next round)."""
    agent_samples: int = 0
    """An agent program's episode (``rollout.agent``): the samples its session made (1 without a fork)."""
    agent_fork_reasons: dict[str, int] = field(default_factory=dict)
    """Its forks by reason (``start`` excluded; see ``endpoint/session.py``)."""
    agent_malformed_calls: int = 0
    """Tool calls the endpoint could not return as calls (malformed, or to a tool the request did not offer)."""
    agent_side_requests: int = 0
    """Requests of the episode outside its main thread (a harness's side calls: titles, checks, token counts)."""
    agent_side_samples: int = 0
    agent_ignored_fields: dict[str, int] = field(default_factory=dict)
    """Requests that carried each accepted-and-ignored field, by metric name (``endpoint/field_policy.py``)."""
    agent_program_failed: int = 0
    agent_timed_out: int = 0
    agent_extra_sample: int = 0
    """1 on a row that is an earlier sample of an agent episode which trains several (``rollout.agent.train_samples``
    ``all``): the episode's statistics are its last sample's row's."""

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class Trajectory:
    """Token ids of one conversation in order, with a parallel loss mask and rollout logprobs.

    ``ids[:prompt_len]`` is the initial prompt; the rest is the response (all turns after
    it). ``loss_mask[i] == 1`` exactly where the engine sampled ``ids[i]``; there
    ``log_probs[i]`` is the engine's logprob of it, elsewhere 0.0. There is no padding, so
    the attention mask is all ones and position ids are ``0..len-1`` (see properties).
    """

    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token (-1 on prompt and environment tokens): a partial rollout's
    segments keep the version they were sampled with."""
    prompt_len: int = 0
    routed_experts: np.ndarray | None = None
    """``[len(ids), moe_layers, top_k]`` int16: the experts the engine's routers chose for each token when it fed
    it (-1 where it never did: the last sampled token, or a context the engine saw in another rendering), or None
    when the engine records none. The first engine call that fed a token sets its row (a prefix cache's view)."""

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def prompt_ids(self) -> list[int]:
        return self.ids[: self.prompt_len]

    @property
    def response_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    @property
    def response_mask(self) -> list[int]:
        return self.loss_mask[self.prompt_len :]

    @property
    def response_log_probs(self) -> list[float]:
        return self.log_probs[self.prompt_len :]

    @property
    def response_versions(self) -> list[int]:
        return self.versions[self.prompt_len :]

    @property
    def attention_mask(self) -> list[int]:
        return [1] * len(self.ids)

    @property
    def position_ids(self) -> list[int]:
        return list(range(len(self.ids)))

    def set_prompt(self, ids: list[int]) -> None:
        """The initial prompt (loss mask 0); only on an empty trajectory."""
        if self.ids:
            raise IllegalTransition("the prompt is set once, on an empty trajectory")
        self.append(ids, sampled=False)
        self.prompt_len = len(ids)

    def append(self, ids: list[int], *, sampled: bool, log_probs: list[float] | None = None, version: int = 0) -> None:
        """Add a segment: engine-sampled (mask 1, ``log_probs`` required, sampled by weight ``version``) or
        environment (mask 0)."""
        if sampled:
            if log_probs is None or len(log_probs) != len(ids):
                raise ValueError(f"sampled segment of {len(ids)} ids needs as many log_probs, got {log_probs!r:.80}")
            self.log_probs.extend(map(float, log_probs))
            self.versions.extend([int(version)] * len(ids))
        else:
            if log_probs is not None:
                raise ValueError("environment tokens carry no log_probs")
            self.log_probs.extend([0.0] * len(ids))
            self.versions.extend([-1] * len(ids))
        self.ids.extend(map(int, ids))
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        if self.routed_experts is not None:
            unknown = np.full((len(ids), *self.routed_experts.shape[1:]), -1, dtype=np.int16)
            self.routed_experts = np.concatenate([self.routed_experts, unknown])

    def record_routing(self, routed: np.ndarray, start: int = 0) -> None:
        """Rows of the engine's routed experts for tokens ``start ..`` (as many as both have); tokens that already
        have theirs keep them."""
        routed = np.asarray(routed, dtype=np.int16)
        if self.routed_experts is None:
            self.routed_experts = np.full((len(self.ids), *routed.shape[1:]), -1, dtype=np.int16)
        elif routed.shape[1:] != self.routed_experts.shape[1:]:
            raise ValueError(f"routed experts {routed.shape[1:]} per token, the trajectory has "
                             f"{self.routed_experts.shape[1:]}")
        stop = min(len(self.ids), start + len(routed))
        if stop <= start:
            return
        rows = self.routed_experts[start:stop]
        unknown = (rows < 0).all(axis=(1, 2))
        rows[unknown] = routed[: stop - start][unknown]

    def exclude_from_loss(self) -> None:
        """Mask every token: the row stays in the batch (shapes, metrics) but trains on nothing."""
        self.loss_mask[:] = [0] * len(self.loss_mask)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (ids, mask and logprobs together)."""
        if length < self.prompt_len:
            raise ValueError(f"cannot cut into the prompt ({self.prompt_len} tokens) to length {length}")
        del self.ids[length:], self.loss_mask[length:], self.log_probs[length:], self.versions[length:]
        if self.routed_experts is not None:
            self.routed_experts = self.routed_experts[:length]


@dataclass
class RolloutRequest:
    """One sample of one prompt: its conversation, trajectory, state and results."""

    request_id: str
    uid: str
    """Shared by the ``n`` samples of one prompt (GRPO groups)."""
    messages: list[dict[str, Any]]
    data_source: str = ""
    ground_truth: Any = None
    tools_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None

    state: RequestState = RequestState.PENDING
    finish_reason: FinishReason | None = None
    error: str | None = None
    """A failed request's error: the exception's type and the first line of its message."""
    error_type: str | None = None
    """A failed request's exception class name."""
    error_traceback: str | None = None
    """A failed request's formatted traceback (capped in length)."""
    trajectory: Trajectory = field(default_factory=Trajectory)
    tool_rewards: dict[str, float] = field(default_factory=dict)
    """Per tool name: sum of step rewards plus ``calc_reward`` at the end."""
    interaction_scores: list[float] = field(default_factory=list)
    """Turn scores returned by the interaction, in order."""
    interaction_final_score: float | None = None
    turn_ends: list[int] = field(default_factory=list)
    """Per assistant turn, in order: the response index of its last sampled token (-1: it sampled nothing)."""
    turn_tool_rewards: list[float] = field(default_factory=list)
    """Per assistant turn: the step rewards (``execute``) of the tool calls it made (also in ``tool_rewards``)."""
    turn_interaction_scores: list[float] = field(default_factory=list)
    """Per assistant turn: the interaction's turn score of the reply that followed it (0.0: none)."""
    turn_source_rewards: list[float] = field(default_factory=list)
    """Per assistant turn: the reward the rollout source gave that turn (an agent program's ``/reward`` posts naming
    it; empty for the built-in loop). Already counted in ``source_reward``: this says which turn earned it."""
    episode_id: str | None = None
    """The episode this row is a sample of (None: its own, ``request_id``); rows of one episode share it."""
    episode_sample: int = 0
    """Which of its episode's trained samples the row is, in the order the session made them."""
    episode_samples: int = 1
    """How many samples of its episode train (several when an agent program's session forked)."""
    turn_offset: int = 0
    """The episode's turn index of this row's first assistant turn: the turns its episode sampled before (in other
    samples of a forked agent session); 0 for a row that is its whole episode."""
    source_reward: float | None = None
    """The reward the rollout source gave the request (an agent program's, ``rollout.agent.reward=program``): it
    stands in for the reward function's (None: the reward function scores the request)."""
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    sanity_check_diffs: list[dict[str, str]] = field(default_factory=list)
    tool_log: list[dict[str, Any]] = field(default_factory=list)
    """One entry per tool call, in order: ``turn``, ``name``, ``arguments`` (JSON text, or the raw call
    text when it did not parse), ``result`` (the observation the model read), ``error``, ``seconds``,
    ``error_type`` (None on success; the exception's class name when the tool raised, ``"TimeoutError"``
    when it ran out of time; ``"tool_error"`` when the tool itself returned an error observation; for the
    model's bad calls ``"malformed_call"``, ``"unknown_tool"``, ``"invalid_arguments"`` or
    ``"too_many_calls"``) and ``traceback`` (of an exception raised inside the tool, else None)."""
    _started: float = 0.0

    def transition(self, new: RequestState) -> None:
        """Move to ``new``; raises :class:`IllegalTransition` if the machine forbids it."""
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.value} -> {new.value} is not allowed")
        if self.state is RequestState.PENDING:
            self._started = time.perf_counter()
        self.state = new

    def complete(self, reason: FinishReason) -> None:
        """End as ``completed``; an engine abort (``aborted``) leaves an unfinished turn, which trains on nothing."""
        self.finish_reason = reason
        self.transition(RequestState.COMPLETED)
        if reason is FinishReason.ABORTED:
            self.trajectory.exclude_from_loss()
        self._close()

    def fail(self, error: str, *, error_type: str | None = None, traceback: str | None = None) -> None:
        """End as ``failed`` (from any live state) with finish reason ``aborted``: the row trains on nothing.

        Its sampled tokens were real samples, but the episode never reached an outcome the reward
        can judge; scored 0 and kept in the loss they would be pushed down for the environment's fault.
        ``error`` is one line (``"Type: message"``); ``error_type`` and ``traceback`` say where it came from.
        """
        if self.state in (RequestState.COMPLETED, RequestState.FAILED):
            raise IllegalTransition(f"request {self.request_id} already ended as {self.state.value}")
        self.error, self.error_type, self.error_traceback = error, error_type, traceback
        self.finish_reason = FinishReason.ABORTED
        self.transition(RequestState.FAILED)
        self.trajectory.exclude_from_loss()
        self._close()

    @property
    def done(self) -> bool:
        return self.state in (RequestState.COMPLETED, RequestState.FAILED)

    def start_turn(self) -> None:
        """Record a new assistant turn that ended at the trajectory's current end (call after its tokens went in)."""
        traj = self.trajectory
        end = traj.response_len - 1
        sampled = end >= 0 and traj.loss_mask[traj.prompt_len + end] == 1
        self.turn_ends.append(end if sampled else -1)
        self.turn_tool_rewards.append(0.0)
        self.turn_interaction_scores.append(0.0)

    @property
    def total_tool_reward(self) -> float:
        return float(sum(self.tool_rewards.values()))

    def _close(self) -> None:
        self.metrics.latency_seconds = time.perf_counter() - self._started if self._started else 0.0
        self.metrics.prompt_tokens = self.trajectory.prompt_len
        self.metrics.response_tokens = self.trajectory.response_len
