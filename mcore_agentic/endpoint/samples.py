"""What a session records: its samples (the exact ids each fed and sampled, its messages, what the client echoes),
the thread each belongs to, where a sample stood before a request's messages went in, a turn in progress, and each
engine call as the engine answered it (what a resumed session replays). :mod:`.session` changes them.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.endpoint.turn import TurnFinish, TurnRequest
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams
from mcore_agentic.rollout.request import Trajectory
from mcore_agentic.rollout.tokenization import ConversationTokenizer


@dataclass(frozen=True)
class ThreadKey:
    """What ties a request to a thread (module docstring): its model name, whether it offers tools, its leading
    system text and its first user message."""

    model: str
    has_tools: bool
    system: str
    first_user: str

    @classmethod
    def of(cls, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> ThreadKey:
        leading = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        system = "\n".join(m.get("content") or "" for m in messages[:leading])  # not mid-conversation ones
        first_user = next((m.get("content") or "" for m in messages if m["role"] == "user"), "")
        return cls(model, bool(tools), system, first_user)

    def joins(self, other: ThreadKey) -> bool:
        return (self.model == other.model and self.has_tools == other.has_tools
                and (self.system == other.system or self.first_user == other.first_user))


@dataclass(frozen=True)
class SessionSettings:
    """What every session of an endpoint shares: length budgets and sampling."""

    prompt_length: int
    """Longest first prompt of a sample (a fork's prompt holds the whole conversation so far)."""
    response_length: int
    """Token budget of a sample after its prompt: every assistant turn and environment message."""
    max_model_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    honor_client_sampling: bool = False
    """False (training): the policy's sampling settings, whatever the client asks (its log-probs must be the
    policy's); the client's temperature/top_p are ignored and counted. True (standalone): the client's."""
    max_messages: int = 512
    """Most messages a request may carry."""
    max_samples: int = 64
    """Most samples (forks) one session may hold; a request past it gets HTTP 429."""
    tools_in_prompt: bool = True
    """False (``rollout.multi_turn.tool_schemas_in_prompt=false``): the template gets no tool list, for a model
    fine-tuned on its tools; the request's tools still decide which calls are parsed."""


@dataclass
class Sample:
    """One token-exact sample of a session: the ids the engine fed and sampled, in order."""

    index: int
    fork_reason: str
    thread: int
    """The thread the sample belongs to (the index of the thread's first sample)."""
    thread_key: ThreadKey
    tools: list[dict[str, Any]] | None
    """The tool list the template renders (None: no tool section)."""
    tools_key: str
    messages: list[dict[str, Any]]
    """As the template renders them: the client's environment messages, our assistant turns as sampled."""
    echo: list[tuple[Any, ...]]
    """Each message as the client should send it back (:func:`message_key`)."""
    tokens: ConversationTokenizer
    trajectory: Trajectory
    num_prompt_messages: int
    last_text: str | None = None
    """The last sampled turn decoded, stop token included (None after an environment message)."""
    last_eot: bool = False
    turns: int = 0
    last_generation: int = -1
    """The session's generation count when this sample last sampled (the latest sample is the episode's row)."""
    first_generation: int = -1
    """The session's generation count at this sample's first turn: the turns the session sampled before it are
    ``first_generation - 1`` (the episode's turn index of the sample's first turn)."""
    finish_reason: TurnFinish | None = None
    busy: bool = False
    exhausted: bool = False
    """A request found no room left in the sample's budget (it got ``context_length_exceeded``): the episode
    ended by length, as the built-in loop's would, whatever the program does next."""
    malformed_calls: int = 0
    turn_ends: list[int] = field(default_factory=list)
    """Per assistant turn of the sample: the response index of its last sampled token (-1: it sampled nothing)."""
    turn_rewards: list[float] = field(default_factory=list)
    """Per assistant turn of the sample: the rewards the agent posted for it (``/reward`` with ``turn``)."""

    @property
    def awaiting_environment(self) -> bool:
        """Whether the sample ends with a turn we sampled, so a request may extend it."""
        return self.turns > 0 and bool(self.echo) and self.echo[-1][0] == "assistant"


@dataclass(frozen=True)
class Mark:
    """Where a sample stood before a request's new messages went in: a turn that samples nothing goes back to it."""

    length: int
    messages: int
    echo: int
    texts: int
    paths: Counter[Any]
    used_fallback: bool

    @classmethod
    def of(cls, sample: Sample) -> Mark:
        tokens = sample.tokens
        # ConversationTokenizer keeps the trajectory's text piece by piece (its ``text``, the sanity check's input).
        return cls(len(sample.trajectory), len(sample.messages), len(sample.echo), len(tokens._texts),
                   Counter(tokens.paths), tokens.used_fallback)

    def restore(self, sample: Sample) -> None:
        tokens = sample.tokens
        sample.trajectory.truncate(self.length)
        del sample.messages[self.messages:], sample.echo[self.echo:], tokens._texts[self.texts:]
        tokens.paths.clear()
        tokens.paths.update(self.paths)
        tokens.used_fallback = self.used_fallback


@dataclass
class Turn:
    """One request's turn while the engine samples it."""

    key: str
    """The session's name of the turn (the engine's request id, when the engine can abort)."""
    sample: Sample
    messages: list[dict[str, Any]]
    request: TurnRequest
    mark: Mark
    prompt_ids: list[int]
    params: SamplingParams
    budget: int
    answered: bool = False
    """The engine has answered (nothing left to abort)."""


@dataclass(frozen=True)
class Segment:
    """One engine call of a session as the engine answered it: what replays the call after a resume."""

    prompt: str
    """The prompt ids' digest (:func:`prompt_digest`)."""
    draws_before: int
    max_new_tokens: int
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    version: int
    """The weight version that sampled it."""
    routed_experts: Any = None

    def output(self) -> GenerationOutput:
        return GenerationOutput(list(self.token_ids), list(self.log_probs), self.finish_reason,
                                routed_experts=self.routed_experts)


def prompt_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()
