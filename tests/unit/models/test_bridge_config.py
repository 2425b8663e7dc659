"""HF config -> Megatron TransformerConfig / GPTModel arguments, field by field, and the bridge's clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from mcore_agentic.models.bridge import BridgeError
from mcore_agentic.models.config import ModelConfig
from mcore_agentic.models.registry import BRIDGES, get_bridge
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.utils.errors import ConfigError


def _Par(tp: int = 1, pp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> ParallelConfig:  # noqa: N802
    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                          sequence_parallel=sequence_parallel)


def _cfg(arch: str, **kw):
    common = dict(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=12345.0,
        tie_word_embeddings=False, initializer_range=0.03,
    )
    common.update(kw)
    cls = {"Qwen2ForCausalLM": transformers.Qwen2Config, "Qwen3ForCausalLM": transformers.Qwen3Config,
           "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig, "LlamaForCausalLM": transformers.LlamaConfig}[arch]
    config = cls(**common)
    config.architectures = [arch]
    return config


@pytest.mark.parametrize("arch", sorted(BRIDGES))
def test_transformer_config_maps_every_field(arch: str) -> None:
    qwen3 = arch.startswith("Qwen3")
    extra = {"head_dim": 24} if qwen3 else {}
    hf = _cfg(arch, **extra)
    bridge = get_bridge(hf)
    t = bridge.transformer_config(hf, _Par(tp=2, pp=1, cp=1), params_dtype=torch.float32)
    assert (t.num_layers, t.hidden_size, t.ffn_hidden_size) == (3, 64, 96)
    assert (t.num_attention_heads, t.num_query_groups) == (4, 2)
    assert t.kv_channels == (24 if qwen3 else 16)
    assert t.normalization == "RMSNorm" and t.layernorm_epsilon == 1e-5
    assert t.gated_linear_unit and t.activation_func is F.silu
    assert t.add_bias_linear is False
    assert t.add_qkv_bias is (arch == "Qwen2ForCausalLM")
    assert t.qk_layernorm is qwen3
    assert t.hidden_dropout == 0.0 and t.attention_dropout == 0.0
    assert t.init_method_std == 0.03
    assert t.tensor_model_parallel_size == 2 and t.pipeline_model_parallel_size == 1 and t.context_parallel_size == 1
    assert t.params_dtype == torch.float32 and not t.bf16 and not t.fp16
    assert not (t.gradient_accumulation_fusion or t.bias_dropout_fusion or t.apply_rope_fusion)
    assert not (t.masked_softmax_fusion or t.persist_layer_norm or t.bias_activation_fusion)
    assert t.use_cpu_initialization is (not torch.cuda.is_available())
    # GPTModel-level arguments: rope base, no scaling, vocabulary padded to 128*TP.
    assert bridge.rope_kwargs(hf) == {"position_embedding_type": "rope", "rotary_base": 12345.0}
    assert bridge.padded_vocab_size(1) == 1024 and bridge.padded_vocab_size(2) == 1024
    assert bridge.padded_vocab_size(4) == 1024 and bridge.padded_vocab_size(3) == 1152


def test_moe_router_and_experts_map_to_megatron() -> None:
    hf = _cfg("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    bridge = get_bridge(hf)
    par = ParallelConfig(expert_model_parallel_size=2)
    t = bridge.transformer_config(hf, par)
    assert (t.num_moe_experts, t.moe_router_topk, t.moe_ffn_hidden_size) == (8, 2, 32)
    assert t.moe_router_score_function == "softmax" and t.moe_router_pre_softmax is False  # renormalised top-k
    assert t.moe_layer_freq == [1, 1, 1] and not t.moe_grouped_gemm and t.moe_token_dispatcher_type == "alltoall"
    assert t.expert_model_parallel_size == 2 and t.moe_aux_loss_coeff == 0.0
    plain = get_bridge(_cfg("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, norm_topk_prob=False))
    assert plain.transformer_config(plain.hf_config, ParallelConfig()).moe_router_pre_softmax is True
    names = bridge.hf_names("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight")
    assert names == ["model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight"]
    assert bridge.hf_names("decoder.layers.0.mlp.router.weight") == ["model.layers.0.mlp.gate.weight"]
    assert bridge.tp_split_dim("decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight") is None
    with pytest.raises(ConfigError, match="num_experts"):
        bridge.transformer_config(hf, ParallelConfig(expert_model_parallel_size=3))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        get_bridge(_cfg("Qwen3MoeForCausalLM", mlp_only_layers=[1]))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        get_bridge(_cfg("Qwen3MoeForCausalLM", num_experts_per_tok=1, norm_topk_prob=True))


def test_expert_parallel_rules_name_the_key() -> None:
    from mcore_agentic.config.rules import check_expert_split

    with pytest.raises(ConfigError, match="expert_tensor_parallel_size"):
        ParallelConfig(expert_tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="actor.expert_model_parallel_size.*divide the 2 ranks"):
        check_expert_split(ParallelConfig(expert_model_parallel_size=4), 2)
    with pytest.raises(ConfigError, match="6 experts"):
        check_expert_split(ParallelConfig(expert_model_parallel_size=4), 4, num_experts=6)
    with pytest.raises(ConfigError, match="no experts"):
        check_expert_split(ParallelConfig(expert_model_parallel_size=2), 2, num_experts=0)
    with pytest.raises(ConfigError, match="actor.tensor_model_parallel_size"):
        check_expert_split(ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2), 4, num_experts=8)
    check_expert_split(ParallelConfig(expert_model_parallel_size=2), 2, num_experts=8)


def test_overrides_and_bf16() -> None:
    hf = _cfg("Qwen2ForCausalLM")
    bridge = get_bridge(hf)
    t = bridge.transformer_config(hf, _Par(pp=3), params_dtype=torch.bfloat16, recompute_granularity="selective")
    assert t.bf16 and t.params_dtype == torch.bfloat16 and t.pipeline_dtype == torch.bfloat16
    assert t.recompute_granularity == "selective"


def test_rope_scaling_variants() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    hf = _cfg("LlamaForCausalLM", rope_scaling=llama3)
    assert get_bridge(hf).rope_kwargs(hf)["rope_scaling_factor"] == 8.0
    hf = _cfg("LlamaForCausalLM", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert get_bridge(hf).rope_kwargs(hf)["seq_len_interpolation_factor"] == 2.0
    with pytest.raises(ConfigError, match=r"rope_scaling\.original_max_position_embeddings"):
        get_bridge(_cfg("LlamaForCausalLM", rope_scaling={**llama3, "original_max_position_embeddings": 4096}))
    with pytest.raises(ConfigError, match=r"rope_scaling\.rope_type.*yarn"):
        get_bridge(_cfg("Qwen2ForCausalLM", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 128}))


def test_unsupported_features_are_named() -> None:
    with pytest.raises(ConfigError, match="architectures.*MistralForCausalLM.*supported are"):
        get_bridge(type("C", (), {"architectures": ["MistralForCausalLM"]})())
    # Exact match only: a name containing a supported one is not served.
    with pytest.raises(ConfigError, match="Qwen2ForCausalLMX"):
        get_bridge(type("C", (), {"architectures": ["Qwen2ForCausalLMX"]})())
    with pytest.raises(ConfigError, match="architectures.*exactly one"):
        get_bridge(type("C", (), {"architectures": None})())
    with pytest.raises(ConfigError, match="hidden_act"):
        get_bridge(_cfg("LlamaForCausalLM", hidden_act="gelu"))
    with pytest.raises(ConfigError, match="attention_bias"):
        get_bridge(_cfg("LlamaForCausalLM", attention_bias=True))
    with pytest.raises(ConfigError, match="use_sliding_window"):
        get_bridge(_cfg("Qwen2ForCausalLM", use_sliding_window=True))
    with pytest.raises(ConfigError, match="num_attention_heads.*tensor_model_parallel_size=8"):
        hf = _cfg("Qwen2ForCausalLM")
        get_bridge(hf).transformer_config(hf, _Par(tp=8))


def test_qkv_fusion_is_per_query_group() -> None:
    hf = _cfg("Qwen2ForCausalLM")  # 4 heads, 2 groups, head_dim 16
    bridge = get_bridge(hf)
    h, hd = 64, 16
    # Tag every row with its HF head id: q heads 0..3 -> 0..3, k heads -> 10+g, v heads -> 20+g.
    q = torch.arange(4).repeat_interleave(hd)[:, None].float().expand(-1, h)
    k = (10 + torch.arange(2)).repeat_interleave(hd)[:, None].float().expand(-1, h)
    v = (20 + torch.arange(2)).repeat_interleave(hd)[:, None].float().expand(-1, h)
    state = {f"model.layers.0.self_attn.{p}_proj.weight": t for p, t in (("q", q), ("k", k), ("v", v))}
    for p, n in (("q", 4), ("k", 2), ("v", 2)):
        state[f"model.layers.0.self_attn.{p}_proj.bias"] = torch.zeros(n * hd)
    fused = bridge.hf_to_megatron_param("decoder.layers.0.self_attention.linear_qkv.weight", state)
    heads = fused[::hd, 0].tolist()
    assert heads == [0, 1, 10, 20, 2, 3, 11, 21]  # group 0: q0 q1 k0 v0 | group 1: q2 q3 k1 v1
    # TP=2 splits by groups: rank 1 holds group 1 only.
    assert bridge.split_tp("decoder.layers.0.self_attention.linear_qkv.weight", fused, 1, 2)[::hd, 0].tolist() == [
        2, 3, 11, 21]
    back = dict(bridge.megatron_param_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", fused))
    assert all(torch.equal(back[k_], state[k_]) for k_ in back)


def test_gated_fc1_tp_layout_and_split_dims() -> None:
    hf = _cfg("Qwen3ForCausalLM")
    bridge = get_bridge(hf)
    name = "decoder.layers.2.mlp.linear_fc1.weight"
    gate = torch.full((96, 64), 1.0)
    up = torch.full((96, 64), 2.0)
    full = bridge.hf_to_megatron_param(
        name, {"model.layers.2.mlp.gate_proj.weight": gate, "model.layers.2.mlp.up_proj.weight": up})
    shard1 = bridge.split_tp(name, full, 1, 2)
    assert shard1[:48].eq(1).all() and shard1[48:].eq(2).all()  # [gate_1; up_1]
    shards = [bridge.split_tp(name, full, r, 2) for r in range(2)]
    assert torch.equal(bridge.merge_tp(name, shards), full)
    dims = {n: bridge.tp_split_dim(n) for n in (
        "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.q_layernorm.weight")}
    assert list(dims.values()) == [0, 0, None, 0, 1, 0, 1, None, None]


def test_param_mapping_errors_name_the_key() -> None:
    hf = _cfg("Qwen3ForCausalLM", tie_word_embeddings=True)
    bridge = get_bridge(hf)
    assert bridge.hf_names("output_layer.weight") == ["model.embed_tokens.weight"]
    assert bridge.megatron_param_to_hf("output_layer.weight", torch.zeros(1024, 64)) == []  # tied copy: not exported
    with pytest.raises(BridgeError, match="model.layers.0.self_attn.q_norm.weight"):
        bridge.hf_to_megatron_param("decoder.layers.0.self_attention.q_layernorm.weight", {})
    with pytest.raises(BridgeError, match=r"model.norm.weight.*\(3,\).*\(64,\)"):
        bridge.hf_to_megatron_param("decoder.final_layernorm.weight", {"model.norm.weight": torch.ones(3)})
    with pytest.raises(BridgeError, match="linear_qkv.bias.*no HF mapping"):
        bridge.hf_names("decoder.layers.0.self_attention.linear_qkv.bias")  # Qwen3 has no qkv bias
    emb = bridge.hf_to_megatron_param("embedding.word_embeddings.weight",
                                      {"model.embed_tokens.weight": torch.ones(1000, 64)}, tp_size=2)
    assert emb.shape == (1024, 64) and emb[1000:].eq(0).all()
    ((name, back),) = bridge.megatron_param_to_hf("embedding.word_embeddings.weight", emb)
    assert name == "model.embed_tokens.weight" and back.shape == (1000, 64)
    # TransformerEngine-spec names (norms fused into the following linear) map like the local ones.
    assert bridge.hf_names("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight") == [
        "model.layers.1.input_layernorm.weight"]
    assert bridge.hf_names("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == [
        "model.layers.1.post_attention_layernorm.weight"]
    assert bridge.tp_split_dim("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") is None
    keys = {"lm_head.weight": 0, "model.layers.0.self_attn.rotary_emb.inv_freq": 0, "model.norm.weight": 0}
    assert sorted(bridge.ignored_hf_keys(keys)) == ["lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]


def test_model_config_validation() -> None:
    assert ModelConfig(model_path="/x").dtype == "float32"
    with pytest.raises(ConfigError, match="model.dtype"):
        ModelConfig(model_path="/x", dtype="fp8")
    with pytest.raises(ConfigError, match="model.model_path"):
        ModelConfig(model_path="")
    with pytest.raises(ConfigError, match="model.transformer_impl"):
        ModelConfig(model_path="/x", transformer_impl="te")


def test_layer_spec_choices() -> None:
    from mcore_agentic.models.bridges._dense import LocalRMSNorm, local_block_spec

    hf = _cfg("Qwen3ForCausalLM")
    bridge = get_bridge(hf)
    spec = bridge.layer_spec(bridge.transformer_config(hf, _Par()), use_te=False)
    attn = spec.submodules.self_attention.submodules
    assert attn.core_attention.__name__ == "LocalDotProductAttention"  # takes packed rows, unlike Megatron's
    assert attn.q_layernorm is LocalRMSNorm and attn.k_layernorm is LocalRMSNorm
    assert spec.submodules.input_layernorm is LocalRMSNorm and spec.submodules.pre_mlp_layernorm is LocalRMSNorm
    # Sequence parallelism on the local spec (megatron's torch norm asserts against it; LocalRMSNorm takes it).
    tcfg = bridge.transformer_config(hf, _Par(tp=2, sequence_parallel=True))
    spec = bridge.layer_spec(tcfg, use_te=False)
    block = local_block_spec(spec, tcfg, None, 0)
    assert block.layer_norm is LocalRMSNorm and len(block.layer_specs) == 3
    norm = LocalRMSNorm(config=tcfg, hidden_size=64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    assert LocalRMSNorm(config=bridge.transformer_config(hf, _Par()), hidden_size=64).weight.sequence_parallel is False
    moe = _cfg("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    moe_bridge = get_bridge(moe)
    with pytest.raises(ConfigError, match="sequence_parallel.*with experts needs the TransformerEngine"):
        moe_bridge.layer_spec(moe_bridge.transformer_config(moe, _Par(tp=2, sequence_parallel=True)), use_te=False)
    pytest.importorskip("mcore_agentic.parallel.local_attention")
    spec = bridge.layer_spec(bridge.transformer_config(hf, _Par(cp=2)), use_te=False)
    assert spec.submodules.self_attention.submodules.core_attention.__name__ == "LocalDotProductAttention"


def test_gpu_fusions_follow_the_spec_and_device() -> None:
    from mcore_agentic.models.transformer_impl import fusion_settings

    names = {"bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
             "gradient_accumulation_fusion", "persist_layer_norm"}
    for use_te, device in [(False, "cpu"), (False, "cuda"), (True, "cpu")]:
        flags = fusion_settings(use_te, device)
        assert set(flags) == names and not any(flags.values()), (use_te, device)
    on = fusion_settings(True, "cuda")
    assert all(on[n] for n in names - {"persist_layer_norm"}) and on["persist_layer_norm"] is False
    # TE's wgrad fusion needs no apex (the output layer, which does, is built without it: test_wgrad_fusion.py)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3MoeForCausalLM"])
def test_transformer_config_takes_the_fusions_of_its_spec(arch: str, monkeypatch) -> None:
    from mcore_agentic.models import transformer_impl as ti

    extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32} if "Moe" in arch else {}
    hf = _cfg(arch, **extra)
    bridge = get_bridge(hf)
    seen: list[bool | None] = []

    def fusions(use_te: bool | None) -> dict[str, bool]:
        seen.append(use_te)
        # the flags TransformerConfig accepts without CUDA/TE (fused RoPE needs TE to be importable)
        return {**ti.fusion_settings(False, "cpu"), "bias_activation_fusion": bool(use_te),
                "bias_dropout_fusion": bool(use_te), "masked_softmax_fusion": bool(use_te)}

    monkeypatch.setattr(ti, "fusions_here", fusions)
    t = bridge.transformer_config(hf, _Par(), use_te=True)
    assert t.bias_activation_fusion and t.bias_dropout_fusion and t.masked_softmax_fusion
    t = bridge.transformer_config(hf, _Par(), use_te=False, bias_dropout_fusion=True)  # overrides still win
    assert not t.bias_activation_fusion and t.bias_dropout_fusion
    bridge.transformer_config(hf, _Par())
    assert seen == [True, False, None]  # None: auto, resolved like layer_spec's
    monkeypatch.undo()
    t = bridge.transformer_config(hf, _Par())  # this CPU machine: auto is the local spec, every fusion off
    assert not any(getattr(t, n) for n in ti.fusion_settings(True, "cuda"))


def test_transformer_impl_maps_to_the_layer_spec(monkeypatch) -> None:
    from mcore_agentic.models import transformer_impl as ti

    assert ti.use_te_for("local") is False and ti.use_te_for("auto") is None
    if ti.transformer_engine_problem() is not None:
        with pytest.raises(ConfigError, match="model.transformer_impl: transformer_engine was asked for but"):
            ti.use_te_for("transformer_engine")
    monkeypatch.setattr(ti, "transformer_engine_problem", lambda: None)  # as on a GPU node with TE
    assert ti.use_te_for("transformer_engine") is True
