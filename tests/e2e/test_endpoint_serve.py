"""The standalone endpoint as a user starts it: ``python -m mcore_agentic.endpoint serve --model DIR``.

A tiny random Qwen2 saved as an HF directory (config, weights, the Qwen tokenizer with its chat template) is
served by the real command; the test opens a session with the printed admin token, talks to it with the
``openai`` client and reads the session's samples back: the ids the trainer would train on, the loss mask
exactly on the sampled ids, one log-prob per sampled token.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from tests.helpers.hf import tiny_qwen2_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_model")
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    Qwen2ForCausalLM(tiny_qwen2_config(vocab=len(tok), max_positions=512)).save_pretrained(path)  # specials too
    tok.save_pretrained(path)
    return path


def test_serve_refuses_a_tokenizer_larger_than_the_model_in_one_line(tmp_path):
    from transformers import Qwen2ForCausalLM

    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    Qwen2ForCausalLM(tiny_qwen2_config(vocab=4096)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "mcore_agentic.endpoint", "serve", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --model: the tokenizer has 4122 tokens")


def test_serve_opens_sessions_and_returns_their_exact_samples(model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "mcore_agentic.endpoint", "serve", "--model", str(model_dir),
                             "--port", "0", "--seed", "3", "--prompt-length", "256", "--response-length", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, deadline = [], time.monotonic() + 180
        while time.monotonic() < deadline and not any(line.startswith("admin token:") for line in lines):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
        text = "".join(lines)
        url = re.search(r"on (http://\S+)", text)
        admin = re.search(r"admin token: (\S+)", text)
        assert url and admin, text[-2000:]
        url, admin = url.group(1), admin.group(1)
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise

        assert httpx.post(f"{url}/sessions").status_code == 401
        opened = httpx.post(f"{url}/sessions", headers={"Authorization": f"Bearer {admin}"}).json()
        from openai import OpenAI

        client = OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "Say something."}]
        reply = client.chat.completions.create(model="any", messages=messages, max_tokens=8, logprobs=True)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        client.chat.completions.create(model="any", messages=messages, max_tokens=8)

        samples = httpx.get(f"{url}/sessions/{opened['session_id']}/samples",
                            headers={"Authorization": f"Bearer {opened['api_key']}"}).json()
        assert samples["forks"] == {"start": 1}
        (sample,) = samples["samples"]
        assert sample["turns"] == 2 and len(sample["ids"]) == len(sample["loss_mask"]) == len(sample["pieces"])
        sampled = [i for i, m in enumerate(sample["loss_mask"]) if m]
        first = reply.choices[0].logprobs.content
        assert len(first) == reply.usage.completion_tokens <= 8
        assert [sample["log_probs"][i] for i in sampled[: len(first)]] == pytest.approx([t.logprob for t in first])
        assert all(sample["log_probs"][i] == 0.0 for i in range(len(sample["ids"])) if not sample["loss_mask"][i])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
