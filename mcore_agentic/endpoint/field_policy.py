"""The endpoint's field policy: what a request may carry that changes nothing here, and how it is counted.

Harnesses are ahead of the SDKs: Claude Code, Codex CLI, Qwen Code and opencode send fields no installed Python
client knows (``context_management``, ``client_metadata``, new beta fields) and fields that steer a hosted service
(prompt caching, storage, service tiers, reasoning effort). None of them changes which tokens this endpoint samples
or trains, so the rule, the one vLLM's and SGLang's servers and LiteLLM's proxy follow, is:

* a field the endpoint **honours** is read and checked (a wrong type is a 400 naming it);
* a field that changes nothing here, known or unknown, is **accepted, ignored and counted**: the request's
  :attr:`~.turn.TurnRequest.ignored` names it, the session counts it, the step logs
  ``agent/ignored_fields/<name>`` (the names of :data:`IGNORED`; any other field is counted as ``other``, so a
  client cannot grow the metric set) and the process logs one line per new name;
* only what would make the trained sample differ from what the client asked for, in a way the endpoint cannot
  honour, is **refused** with a 400 naming the field (``n`` > 1, images, a ``tool_choice`` that
  forces a hosted tool such as web search, background responses, stored prompts and conversations): the list, with
  each reason, is in docs/agents.md. Hosted tools merely *offered* (Codex CLI offers web search by default) are
  left out of the model's tool list and counted (``hosted_tools``). Structured output is accepted and counted
  (``structured_output``): unconstrained, the model's text as sampled (Claude Code's title call asks for a JSON
  schema on every run; refusing it would be an API error in every episode).

Sampling settings (temperature, top_p) are the one middle case: in training the policy's are used whatever the
client asks (its log-probs must be the policy's) and a different value is counted (``client_sampling_ignored``);
the standalone server honours them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

IGNORED: dict[str, str] = {
    # Anthropic Messages
    "cache_control": "prompt-cache breakpoints (any block): the engine's prefix cache needs none",
    "context_management": "server-side context edits: the session never edits a conversation",
    "metadata": "the caller's tags",
    "service_tier": "the hosted service's capacity tier",
    "container": "a hosted code-execution container",
    "thinking": "a thinking budget: a thinking template thinks or not by itself",
    "output_config": "effort settings (output_config.format, structured output, is refused)",
    "top_k": "a sampling cut-off: the policy's sampling settings are used",
    "anthropic-beta": "beta-feature headers",
    "tool_result.is_error": "the chat template has no slot for it: the result's text says what failed",
    "structured_output": "a JSON format to constrain sampling to (response_format, text.format, output_config.format):"
                         " sampling is never constrained here (the log-probs must be the policy's), so the text is "
                         "the model's as sampled and the program validates it",
    "hosted_tools": "server/hosted tools offered (web search, code execution...): the endpoint runs none, so the "
                    "model is not offered them and works without (a tool_choice naming one is refused)",
    # OpenAI Responses
    "client_metadata": "the harness's own tags (Codex CLI)",
    "store": "whether the hosted service stores the response: the session keeps what previous_response_id needs",
    "include": "extra output the hosted service can add (log-probs, which this endpoint honours, excepted)",
    "prompt_cache_key": "a prompt-cache routing key: the engine's prefix cache needs none",
    "reasoning": "reasoning effort and summaries: a thinking template thinks or not by itself",
    "text.verbosity": "a verbosity hint the template cannot express",
    "truncation": "the session never truncates; a conversation that does not fit is context_length_exceeded",
    "parallel_tool_calls": "the model is never constrained: it calls as many tools as it samples",
    "user": "the caller's end-user id",
    "safety_identifier": "the caller's end-user id",
    "max_tool_calls": "a bound on hosted tools",
    "stream_options": "stream options other than Chat's include_usage (which is honoured)",
    # OpenAI Chat Completions
    "seed": "the session seeds each turn itself (reproducible rollouts)",
    "reasoning_effort": "reasoning effort: a thinking template thinks or not by itself",
    "frequency_penalty": "a sampling penalty: the policy's sampling settings are used",
    "presence_penalty": "a sampling penalty: the policy's sampling settings are used",
    "logit_bias": "a sampling bias: the policy's sampling settings are used",
    "verbosity": "a verbosity hint the template cannot express",
    "prediction": "predicted outputs (a latency hint)",
}
"""The fields the endpoint accepts and ignores by name, with why each changes nothing: the metric names
``agent/ignored_fields/<name>``. Anything else a request carries and the endpoint does not read is ``other``."""

OTHER = "other"
IGNORED_METRICS: tuple[str, ...] = (*IGNORED, OTHER)
"""Every ``agent/ignored_fields/<name>`` a step may log (a fixed set: the rollout statistics are reduced by name)."""

_logged: set[str] = set()
_lock = threading.Lock()


def metric_name(field: str) -> str:
    """The metric a field is counted under: its own name when :data:`IGNORED` lists it, else ``other``."""
    return field if field in IGNORED else OTHER


def ignored_top_level(body: dict[str, Any], honoured: Iterable[str]) -> list[str]:
    """The top-level fields of ``body`` the endpoint does not read (null values count as absent)."""
    read = frozenset(honoured)
    return [key for key, value in body.items() if key not in read and value is not None]


def has_key(value: Any, key: str, *, depth: int = 6) -> bool:
    """Whether ``key`` is set (not null) in any object of ``value`` down to ``depth`` levels (``cache_control`` on
    system blocks, message blocks and tools)."""
    if depth < 0:
        return False
    if isinstance(value, dict):
        if value.get(key) is not None:
            return True
        return any(has_key(v, key, depth=depth - 1) for v in value.values() if isinstance(v, dict | list))
    if isinstance(value, list):
        return any(has_key(v, key, depth=depth - 1) for v in value if isinstance(v, dict | list))
    return False


def log_new(fields: Iterable[str], api: str, known: frozenset[str] = frozenset()) -> None:
    """One line per field name the process has not ignored before (whatever the session); ``known``: the API's
    request fields in the installed client, so the line says whether the SDK knows the field (a harness ahead of
    the SDKs sends some it does not)."""
    with _lock:
        new = [f for f in dict.fromkeys(fields) if f not in _logged]
        _logged.update(new)
    for name in new:
        where = f"agent/ignored_fields/{metric_name(name)}"
        origin = "a field of the installed client" if name in known else "a field no installed client defines"
        logger.info("endpoint: %s request field %r (%s) accepted and ignored (it changes nothing sampled here; "
                    "counted as %s)", api, name, origin, where)
