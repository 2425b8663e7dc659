"""A tiny Megatron GPTModel (local spec, fp32) plus the bits a 2-rank gloo test needs."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
SEQ = 16
HIDDEN = 32


def init_parallel(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    model_parallel_cuda_manual_seed(seed)


def transformer_config(**overrides: Any):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        kv_channels=8,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(
    config,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    share_embeddings_and_output_weights: bool = False,
):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
    )


def batch(batch_size: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(batch_size, SEQ)
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids}


def pack(obj: Any) -> bytes:
    """A rank's result as bytes: tensors sent through the multiprocessing queue by reference can vanish
    when the sending rank exits first (seen under load); bytes travel by value."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=False)
