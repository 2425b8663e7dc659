"""What the vLLM adapter hands vLLM and reads back: engine arguments from our settings and the checkpoint
(executor, KV-cache size, allowed ids, the CPU head-size check), sampling arguments, finish reasons."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mcore_agentic.rollout.engines.base import EngineFinishReason, SamplingParams
from mcore_agentic.rollout.engines.vllm_draws import DRAWS_BEFORE_ARG, continues_draws
from mcore_agentic.rollout.engines.vllm_weights import INPROC_BACKEND


def to_vllm_sampling_kwargs(params: SamplingParams, *, allowed_token_ids: list[int] | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ``params`` (output kind set by the engine)."""
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,  # 0 is greedy in vLLM too
        "top_p": params.top_p,
        "top_k": 0 if params.top_k == -1 else params.top_k,  # vLLM: 0 keeps the whole vocabulary
        "stop_token_ids": list(params.stop_token_ids),
        "seed": params.seed,
        "logprobs": 0,  # the sampled token's logprob only
        "detokenize": False,
        "skip_special_tokens": False,
        "ignore_eos": False,
    }
    if allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = allowed_token_ids
    if continues_draws(params):
        kwargs["extra_args"] = {DRAWS_BEFORE_ARG: params.draws_before}
    return kwargs


def from_vllm_finish_reason(reason: str | None) -> EngineFinishReason:
    """vLLM's ``CompletionOutput.finish_reason`` as ours: ``stop``/``length``; anything else (abort, error, unfinished) is ``abort``."""
    return reason if reason in ("stop", "length") else "abort"  # type: ignore[return-value]


def vllm_engine_kwargs(
    model_path: str,
    *,
    device: str,
    tensor_model_parallel_size: int,
    gpu_memory_utilization: float,
    seed: int | None,
    dtype: str,
    max_model_len: int | None,
    kv_cache_memory_bytes: int | None,
    enable_prefix_caching: bool,
    extra: dict[str, Any] | None = None,
    in_trainer_world: bool | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.EngineArgs`` for a colocated rollout engine (``extra`` overrides anything).

    ``in_trainer_world``: whether this process is a rank of an initialised torch.distributed world (default: ask
    torch.distributed); it picks the executor (:func:`executor_backend`)."""
    if tensor_model_parallel_size != 1:
        raise ValueError(
            f"VLLMEngine runs one engine per rank (tensor_model_parallel_size=1), got {tensor_model_parallel_size}: "
            "a tensor-parallel vLLM engine needs a cross-process weight transfer this adapter does not have yet"
        )
    kwargs: dict[str, Any] = {
        "model": model_path,
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "seed": 0 if seed is None else seed,
        "tensor_parallel_size": tensor_model_parallel_size,
        "enable_prefix_caching": enable_prefix_caching,
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": {"backend": INPROC_BACKEND},
        "distributed_executor_backend": executor_backend(device, in_trainer_world),
        "enable_sleep_mode": device != "cpu",
    }
    if device == "cpu":
        kwargs["enforce_eager"] = True  # no graph capture to amortise on CPU
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    kwargs.update(extra or {})
    return kwargs


def executor_backend(device: str, in_trainer_world: bool | None = None) -> str:
    """vLLM's executor for an engine on ``device``: ``external_launcher`` on a GPU inside the trainer's
    torch.distributed world (each torchrun rank hosts its engine on its ``LOCAL_RANK``'s GPU, vLLM's SPMD mode as
    verl colocates it), else ``uni`` (CPU, or a standalone GPU engine such as ``mcore_agentic.endpoint serve``:
    vLLM's own world of one, on the first visible GPU). ``in_trainer_world`` None: ask torch.distributed."""
    if in_trainer_world is None:
        import torch.distributed as dist

        in_trainer_world = dist.is_available() and dist.is_initialized()
    if device != "cpu" and in_trainer_world:
        return "external_launcher"
    index = torch.device(device).index
    if index:  # uni puts its worker on vLLM's device, which carries no index: GPU 0 of those visible
        raise ValueError(f"--device {device}: a vLLM engine outside torchrun runs on the first visible GPU; "
                         f"select this one with CUDA_VISIBLE_DEVICES={index} and --device cuda")
    return "uni"


def text_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (its ``text_config`` for a multimodal wrapper)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return config.get("text_config", config)


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def check_cpu_head_dim(path: Path, config: dict[str, Any]) -> None:
    """One clear line, before vLLM fails deep in its kernels, when its CPU attention cannot take the head size."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = _head_dim(config)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"{path}: head_dim {head_dim} is not one vLLM's CPU attention takes ({supported}); use rollout.name=hf, "
            "or a model with one of those (a tiny preset checkpoint from before head_dim 32: delete it to rebuild)"
        )


def default_kv_cache_bytes(model_path: str | Path, *, max_model_len: int, dtype: str, sequences: int = 64) -> int:
    """KV-cache bytes for ``sequences`` sequences of ``max_model_len`` tokens of the checkpoint's model."""
    config = text_config(model_path)
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    itemsize = 4 if dtype in ("float32", "float") else 2
    per_token = 2 * int(config["num_hidden_layers"]) * kv_heads * _head_dim(config) * itemsize
    return per_token * max_model_len * sequences


def allowed_token_ids(path: Path, vocab_size: int) -> list[int] | None:
    """Every id but the padding ids ``generation_config.json`` suppresses; None when it suppresses none."""
    gen_cfg = path / "generation_config.json"
    if not gen_cfg.exists():
        return None
    blocked = {int(i) for i in json.loads(gen_cfg.read_text()).get("suppress_tokens") or []}
    return [i for i in range(vocab_size) if i not in blocked] if blocked else None


__all__ = [
    "default_kv_cache_bytes",
    "executor_backend",
    "from_vllm_finish_reason",
    "to_vllm_sampling_kwargs",
    "vllm_engine_kwargs",
]
