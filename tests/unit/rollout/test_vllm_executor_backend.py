"""vLLM's executor (GPU review C3): ``external_launcher`` only inside the trainer's torch.distributed world; the
standalone endpoint server (``python -m mcore_agentic.endpoint serve --engine vllm --device cuda``, no torchrun, no
process group, no ``RANK``) gets ``uni``. Pure functions: no vLLM, no GPU."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mcore_agentic.rollout.engines.vllm_args import executor_backend, vllm_engine_kwargs


def _kwargs(device: str, **extra: object) -> dict:
    return vllm_engine_kwargs("/models/x", device=device, tensor_model_parallel_size=1, gpu_memory_utilization=0.4,
                              seed=1, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=None,
                              enable_prefix_caching=True, **extra)


def test_standalone_gpu_engine_runs_uni(monkeypatch):
    """The server's path: no process group, none of torchrun's variables."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    for device in ("cuda", "cuda:0"):
        assert _kwargs(device)["distributed_executor_backend"] == "uni"
        assert _kwargs(device, in_trainer_world=False)["distributed_executor_backend"] == "uni"


def test_trainer_ranks_keep_external_launcher():
    args = _kwargs("cuda:3", in_trainer_world=True)
    assert args["distributed_executor_backend"] == "external_launcher" and args["enable_sleep_mode"]
    assert executor_backend("cpu", in_trainer_world=True) == "uni"  # CPU: uni either way


def test_an_initialised_group_means_the_trainer(tmp_path):
    """Default (``in_trainer_world`` unset): torch.distributed is asked."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert executor_backend("cuda:0") == "external_launcher"
    finally:
        dist.destroy_process_group()
    assert executor_backend("cuda:0") == "uni"


def test_standalone_engine_on_another_gpu_is_one_clear_line():
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=1 and --device cuda") as info:
        executor_backend("cuda:1", in_trainer_world=False)
    assert "\n" not in str(info.value)
