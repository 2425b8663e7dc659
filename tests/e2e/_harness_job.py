"""``launch/pretrain_rl.py`` with the run's real engine forced to a coding harness's script, and each trained
sample recorded.

A tiny random model would not call a harness's shell tool, so in a harness's main conversation (a prompt with a
tool section and the task) the engine's sampled tokens are scripted: the first turn calls the shell tool the
harness offers (``Bash``, ``exec_command`` or ``run_shell_command``) to write ``hello.txt``, the next answers.
Every other request (a side call) gets a short title. Their log-probs are the real model's: one forward of the
run's HF engine model over the prompt and the forced tokens, at the sampling temperature, so the trainer's
importance ratios, KL and updates are those of a policy that sampled them. Weight syncs, releases and the rest go
to the real engine.

``HARNESS_RECORD_DIR``: each trained sample's ids, loss mask, messages and tools as one JSON line per rank
(``rank<k>.jsonl``), for an independent re-render by the test. Run under torchrun like the launcher.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mcore_agentic.rollout.engines as engines  # noqa: E402
from mcore_agentic.endpoint.source import AgentSource  # noqa: E402
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from harness_conformance import HARNESSES, TASK  # noqa: E402  (the task and each harness's shell call)

SHELL_CALLS = {tool: arguments for _binary, tool, arguments in HARNESSES.values()}
"""The shell tool each harness offers (by its exact name), and the call that writes hello.txt."""


class ForcedHarnessEngine:
    """The real engine, its sampled tokens forced to the harness script (module docstring)."""

    def __init__(self, engine: Any, tokenizer: Any):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _reply(self, prompt_ids: list[int]) -> str:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        tool = next((t for t in SHELL_CALLS if f'"name": "{t}"' in text), None)
        if "<tools>" not in text or TASK not in text or tool is None:
            return '{"title": "Write hello.txt"}'
        if text[text.rfind(TASK):].count("<|im_start|>assistant\n") > 1:
            return "Done."
        return f'<tool_call>\n{json.dumps({"name": tool, "arguments": SHELL_CALLS[tool]})}\n</tool_call>'

    @torch.no_grad()
    def _log_probs(self, prompt_ids: list[int], ids: list[int], temperature: float) -> list[float]:
        model = self.engine.model
        device = next(model.parameters()).device
        seq = torch.tensor([list(prompt_ids) + ids], device=device)
        logits = model(input_ids=seq).logits[0, len(prompt_ids) - 1: -1].float() / max(temperature, 1e-6)
        chosen = torch.tensor(ids, device=device)
        return torch.log_softmax(logits, -1).gather(-1, chosen[:, None])[:, 0].tolist()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None) -> GenerationOutput:
        del request_id  # forced replies are computed here, not queued in the engine: nothing to abort by id
        ids = self.tokenizer.encode(self._reply(prompt_ids), add_special_tokens=False) + [self.eot_id]
        ids = ids[: params.max_new_tokens]
        log_probs = await asyncio.to_thread(self._log_probs, list(prompt_ids), ids, params.temperature)
        return GenerationOutput(ids, log_probs, "stop" if ids[-1] == self.eot_id else "length")


_build = engines.build_engine


def _forced_build(cfg: Any, model: Any, **kw: Any) -> Any:
    from transformers import AutoTokenizer

    return ForcedHarnessEngine(_build(cfg, model, **kw), AutoTokenizer.from_pretrained(str(model.model_path)))


engines.build_engine = _forced_build

_take = AgentSource._take


def _recording_take(self: AgentSource, req: Any, sample: Any) -> None:
    _take(self, req, sample)
    record = {"ids": list(sample.trajectory.ids), "loss_mask": list(sample.trajectory.loss_mask),
              "messages": sample.messages, "tools": sample.tools, "thread": sample.thread}
    with open(Path(os.environ["HARNESS_RECORD_DIR"]) / f"rank{dist.get_rank()}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


AgentSource._take = _recording_take

sys.argv[0] = str(ROOT / "launch" / "pretrain_rl.py")
import runpy  # noqa: E402

runpy.run_path(str(ROOT / "launch" / "pretrain_rl.py"), run_name="__main__")
