"""Every request the real harnesses sent (captured from Claude Code, Codex CLI, Qwen Code and opencode by
``tests/fixtures/harness_requests/regenerate.sh``) is accepted by the endpoint's parsers: nothing a harness sends is
refused, and what changes nothing here is named as ignored (the field policy, ``endpoint/field_policy.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mcore_agentic.endpoint import anthropic_messages, openai_chat, responses
from mcore_agentic.endpoint.samples import ThreadKey

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "harness_requests"
ROUTES = {"/v1/messages": anthropic_messages.parse_request, "/v1/responses": responses.parse_request,
          "/v1/chat/completions": openai_chat.parse_request,
          "/v1/messages/count_tokens": anthropic_messages.parse_count_request}


def _requests(name: str) -> list[dict[str, Any]]:
    lines = (FIXTURES / f"{name}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["method"] == "POST"]


def _parse(record: dict[str, Any]) -> Any:
    path = record["path"].split("?")[0]
    route = next(r for r in sorted(ROUTES, key=len, reverse=True) if path.endswith(r))
    return ROUTES[route](record["body"])


HARNESSES = ["claude_code", "codex", "codex_custom_model", "qwen_code", "opencode"]


@pytest.mark.parametrize("name", HARNESSES)
def test_every_captured_request_is_accepted(name):
    parsed = [_parse(r) for r in _requests(name)]
    assert parsed and all(p.messages for p in parsed)


def test_what_each_harness_sends_that_changes_nothing_is_named():
    ignored = {name: set().union(*(_parse(r).ignored for r in _requests(name))) for name in HARNESSES}
    assert {"context_management", "cache_control", "thinking", "metadata", "output_config",
            "structured_output"} <= ignored["claude_code"]
    assert {"client_metadata", "store", "prompt_cache_key", "reasoning", "hosted_tools"} <= ignored["codex"]
    codex = _parse(_requests("codex")[0])
    assert "web_search" not in {t["function"]["name"] for t in codex.tools}
    assert codex.reasoning_passback  # include: reasoning.encrypted_content


def test_each_harness_keeps_one_thread_and_its_side_calls_another():
    """The captured conversations: every main request joins the first main request's thread; the side calls (Claude
    Code's title with a JSON schema, opencode's title) do not."""
    for name in HARNESSES:
        keys = []
        for r in _requests(name):
            p = _parse(r)
            keys.append((ThreadKey.of(p.model, p.messages, p.tools), bool(p.tools)))
        main = [k for k, has_tools in keys if has_tools]
        side = [k for k, has_tools in keys if not has_tools]
        assert main and all(k.joins(main[0]) for k in main), name
        assert not any(k.joins(main[0]) for k in side), name
