"""The Llama-family dense decoder mapping shared by the Llama, Qwen2 and Qwen3 bridges.

RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, no linear biases except the
optional q/k/v bias (Qwen2) and optional per-head q/k RMSNorm (Qwen3). Subclasses
set :attr:`qkv_bias` / :attr:`qk_layernorm` and add their own config checks (without ``qkv_bias``,
the HF ``attention_bias`` must be false).

Megatron layout (local spec names; TE-spec fused norm names are accepted as aliases):

==============================================  ===============================================
Megatron (global)                               HF
==============================================  ===============================================
embedding.word_embeddings.weight  [Vp, H]       model.embed_tokens.weight [V, H] (+ zero pad rows)
decoder.layers.i.input_layernorm.weight         model.layers.i.input_layernorm.weight
  (TE: self_attention.linear_qkv.layer_norm_weight)
decoder.layers.i.self_attention.linear_qkv.*    q_proj/k_proj/v_proj .weight/.bias, fused per
                                                query group g: [q heads of g; k_g; v_g]
decoder.layers.i.self_attention.{q,k}_layernorm model.layers.i.self_attn.{q,k}_norm.weight
decoder.layers.i.self_attention.linear_proj     model.layers.i.self_attn.o_proj.weight
decoder.layers.i.pre_mlp_layernorm.weight       model.layers.i.post_attention_layernorm.weight
  (TE: mlp.linear_fc1.layer_norm_weight)
decoder.layers.i.mlp.linear_fc1.weight          [gate_proj; up_proj]
decoder.layers.i.mlp.linear_fc2.weight          model.layers.i.mlp.down_proj.weight
decoder.final_layernorm.weight                  model.norm.weight
output_layer.weight               [Vp, H]       lm_head.weight (or embed_tokens when tied)
==============================================  ===============================================
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore_agentic.models.bridge import Bridge, BridgeError, ParallelSizes, config_error, hf_tensor

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron hard-codes these Llama-3 rope-scaling constants (RotaryEmbedding._apply_scaling).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Per-layer suffix -> HF suffix for the 1:1 (replicated or simply split) parameters.
_SIMPLE_LAYER_KEYS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TP_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}



def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling dict of an HF config, in either transformers line.

    transformers 5 keeps both in ``rope_parameters`` (``{"rope_theta": ..., "rope_type": ...}``);
    4.x had ``rope_theta`` and an optional ``rope_scaling`` dict.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), params
    return float(hf_config.rope_theta), getattr(hf_config, "rope_scaling", None)

@dataclasses.dataclass(frozen=True)
class _Dims:
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    layers: int


class DenseDecoderBridge(Bridge):
    """Bridge for Llama-style dense decoders; subclasses pin the architecture string and variants."""

    qkv_bias: ClassVar[bool] = False
    qk_layernorm: ClassVar[bool] = False

    # ------------------------------------------------------------------ config
    def check_hf_config(self, hf_config: Any) -> None:
        archs = list(hf_config.architectures or [])
        if archs[:1] != [self.architecture]:
            raise config_error("architectures", f"{archs} is not [{self.architecture!r}] (this bridge's architecture)")
        if hf_config.hidden_act != "silu":
            raise config_error("hidden_act", f"{hf_config.hidden_act!r} is not supported: only 'silu' (SwiGLU)")
        if getattr(hf_config, "mlp_bias", False):
            raise config_error("mlp_bias", "True is not supported: Megatron's add_bias_linear would also add o_proj bias")
        if getattr(hf_config, "use_sliding_window", False):
            raise config_error("use_sliding_window", "True is not supported: set it to false (full causal attention)")
        if hf_config.num_attention_heads % hf_config.num_key_value_heads:
            raise config_error(
                "num_key_value_heads",
                f"{hf_config.num_key_value_heads} does not divide num_attention_heads={hf_config.num_attention_heads}",
            )
        self.rope_kwargs(hf_config)  # raises on unsupported rope scaling
        if not self.qkv_bias and hf_config.attention_bias:
            raise config_error("attention_bias", "True is not supported (it adds an o_proj bias): set it to false")

    def dims(self, hf_config: Any | None = None) -> _Dims:
        c = hf_config or self.hf_config
        # Same default as transformers' attention modules: head_dim falls back to hidden/heads.
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return _Dims(
            hidden=c.hidden_size, ffn=c.intermediate_size, heads=c.num_attention_heads,
            groups=c.num_key_value_heads, head_dim=head_dim, vocab=c.vocab_size, layers=c.num_hidden_layers,
        )

    def rope_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """``GPTModel`` rotary arguments for the config's RoPE base and scaling (see :func:`rope_settings`)."""
        theta, scaling = rope_settings(hf_config)
        kwargs: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": theta}
        if not scaling:
            return kwargs
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type == "default":
            return kwargs
        if rope_type == "linear":
            # HF divides inv_freq by the factor; Megatron divides positions by it: the same angles.
            kwargs["seq_len_interpolation_factor"] = float(scaling["factor"])
            return kwargs
        if rope_type == "llama3":
            for key, value in _MEGATRON_LLAMA3_ROPE.items():
                if float(scaling[key]) != value:
                    raise config_error(
                        f"rope_scaling.{key}", f"{scaling[key]} is not supported: megatron-core fixes it to {value}"
                    )
            kwargs.update(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
            return kwargs
        raise config_error("rope_scaling.rope_type", f"{rope_type!r} is not supported: use default, linear or llama3")

    def transformer_config(
        self, hf_config: Any, parallel: ParallelSizes, *, params_dtype: torch.dtype = torch.float32,
        use_te: bool | None = None, **overrides: Any
    ) -> Any:
        from megatron.core.transformer.transformer_config import TransformerConfig

        from mcore_agentic.models.transformer_impl import fusions_here

        self._check_same(hf_config)
        d = self.dims(hf_config)
        tp = parallel.tensor_model_parallel_size
        if d.heads % tp:
            raise config_error("num_attention_heads", f"{d.heads} is not divisible by tensor_model_parallel_size={tp}")
        kwargs: dict[str, Any] = dict(
            num_layers=d.layers,
            hidden_size=d.hidden,
            ffn_hidden_size=d.ffn,
            num_attention_heads=d.heads,
            num_query_groups=d.groups,
            kv_channels=d.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=hf_config.initializer_range,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            sequence_parallel=parallel.sequence_parallel,
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            use_cpu_initialization=not torch.cuda.is_available(),
            # GPU fusions with the TE spec on CUDA, none on the local spec (it must run on CPU): see fusion_settings.
            **fusions_here(use_te),
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def _check_same(self, hf_config: Any) -> None:
        if hf_config is not self.hf_config and hf_config.to_dict() != self.hf_config.to_dict():
            raise config_error("architectures", "differs from the config this bridge was made for: call get_bridge(hf_config) again")

    # ------------------------------------------------------------------ model
    def layer_spec(self, tcfg: Any, *, use_te: bool | None = None) -> Any:
        """Local megatron-core spec with :class:`LocalDotProductAttention` (CP and packed rows) and
        :class:`LocalRMSNorm` (sequence parallelism), or the TE spec when asked and usable."""
        if use_te is None:
            use_te = _te_usable()
        if use_te:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.qk_layernorm)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(qk_layernorm=self.qk_layernorm, normalization="RMSNorm")
        # Megatron's local DotProductAttention takes neither CP nor packed (THD) rows; this one takes both.
        from mcore_agentic.parallel.local_attention import LocalDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = LocalDotProductAttention
        return with_local_norms(spec)

    def build_model(
        self,
        hf_config: Any,
        tcfg: Any,
        *,
        vp_stage: int | None = None,
        pg_collection: Any | None = None,
        parallel_output: bool = True,
        use_te: bool | None = None,
    ) -> list[Any]:
        """This rank's ``GPTModel`` chunk(s) (all virtual stages unless ``vp_stage`` picks one).

        ``pg_collection``: the process groups to build with (``ParallelLayout.process_groups()``, as the engine
        passes them); None takes megatron's global ones (a bare model built outside an engine)."""
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.process_groups_config import ProcessGroupCollection

        self._check_same(hf_config)
        tp_size = tcfg.tensor_model_parallel_size
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        pp_rank = dist.get_rank(pg_collection.pp) if pg_collection.pp is not None else 0
        pp_size = tcfg.pipeline_model_parallel_size
        vp_size = tcfg.virtual_pipeline_model_parallel_size
        stages = [vp_stage] if vp_stage is not None else (list(range(vp_size)) if vp_size else [None])
        use_te = _te_usable() if use_te is None else use_te
        # Without apex, the output layer cannot take the TE linears' wgrad fusion: the model gets a config without it.
        from mcore_agentic.models.wgrad_fusion import split_wgrad_fusion

        model_config, spec = split_wgrad_fusion(tcfg, self.layer_spec(tcfg, use_te=use_te))
        chunks = []
        for stage in stages:
            first_vp = stage is None or stage == 0
            last_vp = stage is None or stage == vp_size - 1
            chunks.append(
                GPTModel(
                    config=model_config,
                    transformer_layer_spec=spec if use_te else local_block_spec(spec, model_config, stage, pp_rank),
                    vocab_size=self.padded_vocab_size(tp_size),
                    max_sequence_length=hf_config.max_position_embeddings,
                    pre_process=pp_rank == 0 and first_vp,
                    post_process=pp_rank == pp_size - 1 and last_vp,
                    parallel_output=parallel_output,
                    share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
                    pg_collection=pg_collection,
                    vp_stage=stage,
                    **self.rope_kwargs(hf_config),
                )
            )
        return chunks

    # ------------------------------------------------------------------ per-parameter mapping
    def _split(self, global_name: str) -> tuple[int | None, str]:
        match = _LAYER.match(global_name)
        if match:
            return int(match.group(1)), match.group(2)
        return None, global_name

    def hf_names(self, global_name: str) -> list[str]:
        layer, suffix = self._split(global_name)
        if layer is None:
            if global_name == "embedding.word_embeddings.weight":
                return ["model.embed_tokens.weight"]
            if global_name == "output_layer.weight":
                return ["model.embed_tokens.weight" if self.hf_config.tie_word_embeddings else "lm_head.weight"]
            if global_name == "decoder.final_layernorm.weight":
                return ["model.norm.weight"]
        else:
            prefix = f"model.layers.{layer}."
            if suffix in _SIMPLE_LAYER_KEYS and self._layer_key_enabled(suffix):
                return [prefix + _SIMPLE_LAYER_KEYS[suffix]]
            if suffix == "self_attention.linear_qkv.weight" or (
                suffix == "self_attention.linear_qkv.bias" and self.qkv_bias
            ):
                kind = suffix.rsplit(".", 1)[1]
                return [f"{prefix}self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")]
            if suffix == "mlp.linear_fc1.weight":
                return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
        raise BridgeError(f"Megatron parameter {global_name!r} has no HF mapping in the {self.architecture} bridge")

    def _layer_key_enabled(self, suffix: str) -> bool:
        return self.qk_layernorm or "_layernorm.weight" not in suffix or not suffix.startswith("self_attention.")

    def tp_split_dim(self, megatron_name: str) -> int | None:
        layer, suffix = self._split(megatron_name)
        if layer is None:
            return 0 if megatron_name in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        return _TP_DIM.get(suffix)

    def is_gated_fc1(self, megatron_name: str) -> bool:
        return megatron_name.endswith("mlp.linear_fc1.weight")

    def skip_on_export(self, global_name: str) -> bool:
        tied = global_name == "output_layer.weight" and bool(self.hf_config.tie_word_embeddings)
        return tied or super().skip_on_export(global_name)

    def ignored_hf_keys(self, hf_state: Mapping[str, torch.Tensor]) -> list[str]:
        # Some tied checkpoints still store lm_head.weight (a copy of embed_tokens), and old Llama ones the
        # RoPE inverse frequencies (recomputed from rope_theta): neither carries a weight.
        ignored = [key for key in hf_state if key.endswith("rotary_emb.inv_freq")]
        if self.hf_config.tie_word_embeddings and "lm_head.weight" in hf_state:
            ignored.append("lm_head.weight")
        return ignored

    def _hf_shape(self, hf_name: str) -> tuple[int, ...]:
        d = self.dims()
        leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
        shapes = {
            "model.embed_tokens.weight": (d.vocab, d.hidden),
            "lm_head.weight": (d.vocab, d.hidden),
            "model.norm.weight": (d.hidden,),
            "input_layernorm.weight": (d.hidden,),
            "post_attention_layernorm.weight": (d.hidden,),
            "self_attn.q_norm.weight": (d.head_dim,),
            "self_attn.k_norm.weight": (d.head_dim,),
            "self_attn.q_proj.weight": (d.heads * d.head_dim, d.hidden),
            "self_attn.k_proj.weight": (d.groups * d.head_dim, d.hidden),
            "self_attn.v_proj.weight": (d.groups * d.head_dim, d.hidden),
            "self_attn.q_proj.bias": (d.heads * d.head_dim,),
            "self_attn.k_proj.bias": (d.groups * d.head_dim,),
            "self_attn.v_proj.bias": (d.groups * d.head_dim,),
            "self_attn.o_proj.weight": (d.hidden, d.heads * d.head_dim),
            "mlp.gate_proj.weight": (d.ffn, d.hidden),
            "mlp.up_proj.weight": (d.ffn, d.hidden),
            "mlp.down_proj.weight": (d.hidden, d.ffn),
        }
        return shapes[leaf]

    def hf_to_megatron_param(
        self, global_name: str, hf_state: Mapping[str, torch.Tensor], *, tp_size: int = 1
    ) -> torch.Tensor:
        names = self.hf_names(global_name)
        parts = [hf_tensor(hf_state, n, self._hf_shape(n), global_name) for n in names]
        _, suffix = self._split(global_name)
        if suffix.startswith("self_attention.linear_qkv.") and suffix != "self_attention.linear_qkv.layer_norm_weight":
            return self._fuse_qkv(*parts)
        if suffix == "mlp.linear_fc1.weight":
            return torch.cat(parts, dim=0)
        if global_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return self._pad_vocab(parts[0], self.padded_vocab_size(tp_size))
        return parts[0]

    def megatron_param_to_hf(self, global_name: str, full_tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.skip_on_export(global_name):
            return []
        names = self.hf_names(global_name)
        _, suffix = self._split(global_name)
        if suffix.startswith("self_attention.linear_qkv.") and suffix != "self_attention.linear_qkv.layer_norm_weight":
            tensors = self._unfuse_qkv(full_tensor)
        elif suffix == "mlp.linear_fc1.weight":
            tensors = list(full_tensor.chunk(2, dim=0))
        elif global_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensors = [full_tensor[: self.dims().vocab]]
        else:
            tensors = [full_tensor]
        out = []
        for name, tensor in zip(names, tensors, strict=True):
            if tuple(tensor.shape) != self._hf_shape(name):
                raise BridgeError(f"{global_name} -> {name}: shape {tuple(tensor.shape)} != HF {self._hf_shape(name)}")
            out.append((name, tensor.contiguous()))
        return out

    # ------------------------------------------------------------------ layout helpers
    @staticmethod
    def _pad_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
        # Padding rows are zero: their logits are 0 and must be masked by whoever reads the full vocab.
        padded = torch.zeros((rows, weight.shape[1]), dtype=weight.dtype)
        padded[: weight.shape[0]] = weight
        return padded

    def _fuse_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[q; k; v] (HF) -> per query group [q heads of g; k_g; v_g] (Megatron)."""
        d = self.dims()
        rest = q.shape[1:]
        per_group = d.heads // d.groups
        q = q.reshape(d.groups, per_group, d.head_dim, *rest)
        k = k.reshape(d.groups, 1, d.head_dim, *rest)
        v = v.reshape(d.groups, 1, d.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def _unfuse_qkv(self, fused: torch.Tensor) -> list[torch.Tensor]:
        d = self.dims()
        rest = fused.shape[1:]
        per_group = d.heads // d.groups
        grouped = fused.reshape(d.groups, per_group + 2, d.head_dim, *rest)
        q = grouped[:, :per_group].reshape(d.heads * d.head_dim, *rest)
        k = grouped[:, per_group].reshape(d.groups * d.head_dim, *rest)
        v = grouped[:, per_group + 1].reshape(d.groups * d.head_dim, *rest)
        return [q, k, v]


class LocalRMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm: megatron-core's ``WrappedTorchNorm`` (a ``torch.nn.RMSNorm``) that also takes
    sequence parallelism.

    Under SP each TP rank normalises its own ``s / tp`` tokens (a per-token op), so the weight's gradient on a
    rank sums over those tokens only: the weight is marked ``sequence_parallel`` and Megatron's
    ``finalize_model_grads`` all-reduces it over TP, as TE's and apex's norms mark theirs. megatron-core's torch
    norm asserts against SP for want of that mark. Same constructor as ``WrappedTorchNorm``; same parameter.
    """

    def __init__(
        self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False, normalization: str = "RMSNorm",
    ) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma or config.persist_layer_norm:
            raise ValueError("LocalRMSNorm is a plain RMSNorm: normalization=RMSNorm, no zero-centred gamma or "
                             "persist_layer_norm")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def with_local_norms(spec: Any) -> Any:
    """``spec`` (a local layer spec) with every norm :class:`LocalRMSNorm` (Qwen3's q/k norms included)."""
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = LocalRMSNorm
    attn = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name, None) is not None and getattr(attn, name).__name__ == "WrappedTorchNorm":
            setattr(attn, name, LocalRMSNorm)
    return spec


def local_block_spec(layer_spec: Any, tcfg: Any, vp_stage: int | None, pp_rank: int) -> Any:
    """The decoder block of a local layer spec, with a :class:`LocalRMSNorm` final norm.

    Given a layer spec, megatron-core takes the final norm from its own module globals (TE's, apex's, or its
    torch norm, which refuses sequence parallelism): the block spec names it instead, with the layer count
    megatron-core itself would build on this (virtual) pipeline stage.
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layers = get_num_layers_to_build(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=LocalRMSNorm)


def _te_usable() -> bool:
    """TransformerEngine is used only when it imports and a GPU is present (``model.transformer_impl=auto``)."""
    from mcore_agentic.models.transformer_impl import te_spec_here

    return te_spec_here(None)
