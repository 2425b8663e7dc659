"""Qwen3-MoE's experts with the TransformerEngine spec are megatron-core's ``TEGroupedMLP`` (grouped GEMM), and the
bridge maps its parameters, ``experts.linear_fc{1,2}.weight<j>`` per local expert ``j``, to HF's per-expert names
under the *global* expert index: both ways, at EP=2 (each of 2 gloo ranks holds 4 of the 8 experts).

TransformerEngine does not install without CUDA: the model is megatron-core's own TE layer spec
(``get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True)``, through the bridge) built with
stand-ins for TE's layers that make TE's parameters under TE's names (``_te_stand_ins.py``). Built on the meta device
for the names, and on CPU to load the checkpoint through the bridge and export it again (the bridge's own export and
the sharding manager's streaming exporter). The local spec (CPU) keeps ``SequentialMLP``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mcore_agentic.models.bridge import BridgeError
from mcore_agentic.models.registry import get_bridge
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.utils.errors import ConfigError
from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import make_tiny_hf, pack, unpack

ARCH = "Qwen3MoeForCausalLM"
EXPERTS, EP, LAYERS = 8, 2, 2


def _body(rank: int, world_size: int, path: str) -> bytes:
    from safetensors.torch import load_file

    import megatron_patches
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.sharding.exporter import StreamingExporter
    from tests.unit.models._te_stand_ins import te_stand_ins

    megatron_patches.apply()
    par = ParallelConfig(expert_model_parallel_size=EP)
    initialize_parallel(par, seed=1234)
    hf_config = load_hf_config(path)
    bridge = get_bridge(hf_config)
    on_disk = load_file(str(Path(path) / "model.safetensors"))
    with te_stand_ins():
        tcfg = bridge.transformer_config(hf_config, par, use_te=True)
        spec = bridge.layer_spec(tcfg, use_te=True)
        with torch.device("meta"):
            meta = bridge.build_model(hf_config, tcfg, use_te=True)
        chunks = bridge.build_model(hf_config, tcfg, use_te=True)
    local_to_global = {name: bridge.global_name(meta[0], name) for name, _ in meta[0].named_parameters()}
    bridge.load_hf_weights(chunks, path)  # every HF key used by some rank, every shape checked
    loaded = {}
    for name, param in bridge.local_params(chunks).items():
        if bridge.is_expert(name):
            hf = torch.cat([on_disk[n] for n in bridge.hf_names(name)], dim=0)
            loaded[name] = torch.equal(param.detach(), hf)
    exported = dict(bridge.export_hf_weights(chunks))
    streamed = {}
    for bucket in StreamingExporter(bridge, chunks, bucket_bytes=1 << 16).buckets():
        streamed.update((name, tensor.clone()) for name, tensor in bucket)
    return pack({
        "grouped": tcfg.moe_grouped_gemm,
        "experts_module": spec.submodules.mlp.submodules.experts.module.__name__,
        "local_to_global": local_to_global,
        "loaded": loaded,
        "export_equal": sorted(exported) == sorted(on_disk) and all(torch.equal(exported[k], v) for k, v in on_disk.items()),
        "stream_equal": sorted(streamed) == sorted(on_disk) and all(torch.equal(streamed[k], v) for k, v in on_disk.items()),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    path = make_tiny_hf(ARCH, tmp_path_factory.mktemp("moe_te") / ARCH, layers=LAYERS)
    return [unpack(r) for r in run_distributed(_body, world_size=EP, args=(str(path),))]


def test_the_te_spec_runs_the_experts_as_one_grouped_gemm(runs) -> None:
    for res in runs:
        assert res["grouped"] is True
        assert res["experts_module"] == "TEGroupedMLP"


def test_each_ep_rank_names_its_grouped_experts_by_global_index(runs) -> None:
    per_local = EXPERTS // EP
    grouped = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
    for rank, res in enumerate(runs):
        experts = {k: v for k, v in res["local_to_global"].items() if ".experts." in k}
        assert len(experts) == LAYERS * 2 * per_local  # fc1 and fc2 of each local expert, per layer
        for local, global_ in experts.items():
            local_match, global_match = grouped.match(local), grouped.match(global_)
            assert local_match and global_match, (local, global_)
            assert global_match.group(1, 2) == local_match.group(1, 2)
            assert int(global_match.group(3)) == rank * per_local + int(local_match.group(3))


def test_the_checkpoint_loads_into_grouped_experts_and_exports_unchanged(runs) -> None:
    for rank, res in enumerate(runs):
        assert len(res["loaded"]) == LAYERS * 2 * EXPERTS // EP and all(res["loaded"].values()), rank
        assert res["export_equal"], f"rank {rank}: the bridge's export differs from the checkpoint"
        assert res["stream_equal"], f"rank {rank}: the streaming export (weight sync) differs from the checkpoint"


def _hf():
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=12,
        norm_topk_prob=True, tie_word_embeddings=False,
    )
    config.architectures = [ARCH]
    return config


def test_grouped_expert_names_map_to_hf_both_ways() -> None:
    bridge = get_bridge(_hf())
    fc1, fc2 = "decoder.layers.1.mlp.experts.linear_fc1.weight5", "decoder.layers.1.mlp.experts.linear_fc2.weight5"
    assert bridge.hf_names(fc1) == ["model.layers.1.mlp.experts.5.gate_proj.weight",
                                    "model.layers.1.mlp.experts.5.up_proj.weight"]
    assert bridge.hf_names(fc2) == ["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert bridge.is_expert(fc1) and bridge.is_expert(fc2) and bridge.tp_split_dim(fc1) is None
    assert bridge.expert("decoder.layers.0.mlp.experts.linear_fc2.weight12") == (12, "linear_fc2")
    assert bridge.expert("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight") == (3, "linear_fc1")
    assert not bridge.is_expert("decoder.layers.0.mlp.router.weight")
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(12, 16, generator=gen) for n in bridge.hf_names(fc1)}
    hf["model.layers.1.mlp.experts.5.down_proj.weight"] = torch.randn(16, 12, generator=gen)
    full = bridge.hf_to_megatron_param(fc1, hf)
    assert torch.equal(full, torch.cat([hf[n] for n in bridge.hf_names(fc1)]))  # [gate; up], as TEGroupedMLP's GLU
    assert all(torch.equal(t, hf[n]) for n, t in bridge.megatron_param_to_hf(fc1, full))
    down = bridge.megatron_param_to_hf(fc2, bridge.hf_to_megatron_param(fc2, hf))
    assert [n for n, _ in down] == bridge.hf_names(fc2) and torch.equal(down[0][1], hf[bridge.hf_names(fc2)[0]])
    with pytest.raises(BridgeError, match="no HF mapping"):  # megatron's legacy GroupedMLP: all experts in one
        bridge.hf_names("decoder.layers.0.mlp.experts.weight1")


def test_the_local_spec_keeps_sequential_experts() -> None:
    hf = _hf()
    bridge = get_bridge(hf)
    tcfg = bridge.transformer_config(hf, ParallelConfig(), use_te=False)
    assert tcfg.moe_grouped_gemm is False
    assert bridge.layer_spec(tcfg, use_te=False).submodules.mlp.submodules.experts.module.__name__ == "SequentialMLP"
    grouped = bridge.transformer_config(hf, ParallelConfig(), use_te=False, moe_grouped_gemm=True)
    with pytest.raises(ConfigError, match="moe_grouped_gemm: is TransformerEngine's grouped GEMM"):
        bridge.layer_spec(grouped, use_te=False)
