"""Harness x chat template conformance: each coding harness, run headless from its recipe (``examples/harnesses``)
as ``rollout.agent.command`` against its session of the real endpoint, through the real ``AgentSource``.

The engine is scripted (a tiny random model would not call a shell tool): in the harness's main conversation (a
prompt with a tool section) its first turn calls the harness's shell tool to write ``hello.txt`` and its second
answers; any other request (a side call: a title, a topic or next-speaker check) gets a short JSON object. Each
template's own formats are sampled: hermes calls (qwen2_5, qwen3 with a thinking block first), XML calls
(qwen3_coder). Per harness x template the table reports:

* ``ends``: the program exited 0 and the reward command found ``hello.txt`` (the model's shell call ran);
* ``samples``: samples of the episode (its main thread), ``forks`` by reason, ``side`` requests (other threads and
  token counts: not trained);
* ``exact``: the trained sample equals a full render of its messages (the end-of-trajectory check, strict);
* ``prefix``: the share of the main thread's prompt tokens after its first request that were a prefix the engine
  had already been fed (what vLLM's prefix cache or SGLang's radix cache can serve), and the prompt tokens of its
  first request.

Usage: ``python bench/harness_conformance.py [--harness claude_code codex ...] [--template qwen2_5 ...] [--lean]
[--sandbox] [--jobs 3]``; prints a markdown table (docs/agents.md's conformance table is its output, kept current by
``tests/e2e/test_harness_conformance.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mcore_agentic.endpoint.source import AgentSource  # noqa: E402
from mcore_agentic.models.tokenizer import load_qwen_tokenizer  # noqa: E402
from mcore_agentic.rollout.config import AgentConfig, AgentSandboxLimits, MultiTurnConfig, RolloutConfig  # noqa: E402
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams  # noqa: E402
from mcore_agentic.rollout.tokenization import ChatTokenizer  # noqa: E402

RECIPES = ROOT / "examples" / "harnesses"
HARNESS_BIN = ROOT / ".harnesses" / "node_modules" / ".bin"
HARNESSES: dict[str, tuple[str, str, dict[str, Any]]] = {  # recipe -> (binary, shell tool, its arguments)
    "claude_code": ("claude", "Bash", {"command": "echo hi > hello.txt", "description": "Write hello.txt"}),
    "codex": ("codex", "exec_command", {"cmd": "echo hi > hello.txt"}),
    "qwen_code": ("qwen", "run_shell_command", {"command": "echo hi > hello.txt", "description": "Write hello.txt"}),
    "opencode": ("opencode", "bash", {"command": "echo hi > hello.txt", "description": "Write hello.txt"}),
}
TEMPLATES = {"qwen2_5": "hermes", "qwen3": "hermes", "qwen3_coder": "qwen3_coder"}
TASK = "Create a file hello.txt containing hi using the shell, then say done."
SIDE_REPLY = '{"title": "Write hello.txt", "isNewTopic": false, "next_speaker": "user", "reasoning": "done"}'
REWARD = "/bin/sh -c 'test -f hello.txt && echo 1 || echo 0'"


def call_text(template: str, name: str, arguments: dict[str, Any]) -> str:
    """The shell call as the template's model writes it (a thinking block first under qwen3)."""
    if template == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    text = f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
    return f"<think>\nThe shell can write the file.\n</think>\n\n{text}" if template == "qwen3" else text


class HarnessEngine:
    """A scripted ``RolloutEngine`` for one harness's episode; records every prompt it was fed (module docstring)."""

    def __init__(self, tokenizer: Any, template: str, tool: str, arguments: dict[str, Any]):
        self.tokenizer = tokenizer
        self.eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        final = "<think>\nDone.\n</think>\n\nDone." if template == "qwen3" else "Done."
        self.replies = [call_text(template, tool, arguments), final]
        self.side = f"<think>\nA title.\n</think>\n\n{SIDE_REPLY}" if template == "qwen3" else SIDE_REPLY
        self.weight_version = 0
        self.fed: list[tuple[list[int], list[int], bool]] = []
        """Per generation: the prompt ids, the sampled ids, and whether it was the main conversation."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        main = "<tools>" in text and TASK in text
        turns = text[text.rfind(TASK):].count("<|im_start|>assistant\n") - 1  # turns since the task
        reply = self.replies[min(turns, len(self.replies) - 1)] if main else self.side
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.eot_id]
        ids = ids[: params.max_new_tokens]
        self.fed.append((list(prompt_ids), ids, main))
        return GenerationOutput(ids, [-1.0] * len(ids), "stop")


def reused_prefix(fed: list[tuple[list[int], list[int], bool]]) -> tuple[float, int]:
    """The share of the main conversation's later prompt tokens (every request after its first) that an engine had
    been fed before (as a prompt, or a prompt and its sampled ids: the longest common prefix with any earlier
    sequence), and the first prompt's size."""
    seen: list[list[int]] = []
    total = hit = 0
    first = 0
    for prompt, ids, main in fed:
        best = 0
        for earlier in seen:
            n = min(len(earlier), len(prompt))
            k = next((i for i in range(n) if earlier[i] != prompt[i]), n)
            best = max(best, k)
        if main and first:  # the first main request has nothing to reuse (but a side call's prefix, if any)
            total += len(prompt)
            hit += best
        elif main:
            first = len(prompt)
        seen.append(prompt + ids)
    return (hit / total if total else 0.0), first


@dataclass
class Row:
    harness: str
    template: str
    ends: bool
    samples: int
    forks: dict[str, int]
    side: int
    exact: bool
    prefix: float
    first_prompt: int
    error: str = ""

    def cells(self) -> list[str]:
        forks = ", ".join(f"{k} {v}" for k, v in sorted(self.forks.items())) or "none"
        return [self.harness, self.template, "yes" if self.ends else f"no ({self.error[:60]})", str(self.samples),
                forks, str(self.side), "yes" if self.exact else "no", f"{self.prefix:.1%}", str(self.first_prompt)]


def run_one(harness: str, template: str, *, lean: bool, sandbox: bool, timeout_s: float = 180.0) -> Row:
    binary, tool, arguments = HARNESSES[harness]
    tok = load_qwen_tokenizer(template)
    engine = HarnessEngine(tok, template, tool, arguments)
    scratch = Path(tempfile.mkdtemp(prefix="harness-conformance-"))
    (scratch / "repo").mkdir()
    (scratch / "samples").mkdir()
    env = f"env HARNESS_BIN={HARNESS_BIN} HARNESS_LEAN={int(lean)}"
    limits = AgentSandboxLimits(memory_cgroup="auto", extra_read_paths=(str(ROOT / ".harnesses"), str(RECIPES)))
    cfg = RolloutConfig(
        prompt_length=131072, response_length=4096, n=1, seed=7,
        multi_turn=MultiTurnConfig(format=TEMPLATES[template], tokenization_sanity_check_mode="strict"),
        agent=AgentConfig(command=f"{env} /bin/sh {RECIPES / harness}.sh", timeout_s=timeout_s,
                          sandbox="bwrap" if sandbox else "none", workdir=str(scratch / "repo"),
                          reward_command=REWARD, sample_dirs=str(scratch / "samples"), sandbox_limits=limits))
    rows = [{"prompt": [{"role": "user", "content": TASK}], "data_source": "harness"}]
    source = AgentSource(cfg, engine, ChatTokenizer(tok), version=lambda: 0)
    try:
        batch = source.roll_out(rows, cfg)
    finally:
        source.close()
        shutil.rmtree(scratch, ignore_errors=True)
    m = batch["request_metrics"][-1]
    prefix, first = reused_prefix(engine.fed)
    failed = m.get("state") == "failed"
    error = "" if not failed else str((batch.meta.get("errors") or [""])[-1] or "failed")
    return Row(harness, template, ends=not failed and batch["source_reward"][-1] == 1.0,
               samples=m.get("agent_samples", 0), forks=m.get("agent_fork_reasons") or {},
               side=m.get("agent_side_requests", 0), exact=not failed and not m.get("sanity_check_mismatch", 1),
               prefix=prefix, first_prompt=first, error=error)


HEADER = ["harness", "template", "runs to the end", "samples", "forks", "side requests", "exact (re-render)",
          "prefix reused, turns 2+", "first prompt tokens"]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def run_all(harnesses: list[str], templates: list[str], *, lean: bool = False, sandbox: bool = False,
            jobs: int = 1) -> list[Row]:
    """:func:`run_one` for every harness x template, ``jobs`` at a time (each its own endpoint, engine and program:
    the harnesses' start-up is most of a run), in table order."""
    pairs = [(h, t) for h in harnesses for t in templates]
    for template in templates:  # transformers' lazy imports are not thread-safe: import them here first
        load_qwen_tokenizer(template)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        return list(pool.map(lambda p: run_one(*p, lean=lean, sandbox=sandbox), pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--harness", nargs="+", default=list(HARNESSES), choices=list(HARNESSES))
    ap.add_argument("--template", nargs="+", default=list(TEMPLATES), choices=list(TEMPLATES))
    ap.add_argument("--lean", action="store_true", help="HARNESS_LEAN=1: the shell tool and a one-line prompt")
    ap.add_argument("--sandbox", action="store_true", help="rollout.agent.sandbox=bwrap")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    args = ap.parse_args()
    installed = [h for h in args.harness if (HARNESS_BIN / HARNESSES[h][0]).exists()]
    for harness in sorted(set(args.harness) - set(installed)):
        print(f"{harness}: not installed under {HARNESS_BIN} (make harnesses)", file=sys.stderr)
    print(table(run_all(installed, args.template, lean=args.lean, sandbox=args.sandbox, jobs=args.jobs)))


if __name__ == "__main__":
    main()
