"""``gradient_accumulation_fusion`` with the TransformerEngine spec on CUDA and no apex: every TE linear fuses its
weight-gradient accumulation (TE's own kernel), and megatron-core's output layer, which refuses the flag without
apex's ``fused_weight_gradient_mlp_cuda``, is built unfused.

TransformerEngine does not install without CUDA: the model is megatron-core's own GPTModel and TE layer spec, built
through the bridge with stand-ins for TE's layers that keep the flag TE would get (``_te_stand_ins.py``); its output
layer is megatron-core's real ``ColumnParallelLinear``. Apex is not installed here either.
"""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import make_tiny_hf


def test_te_on_cuda_fuses_wgrad_accumulation_without_apex() -> None:
    from mcore_agentic.models.transformer_impl import fusion_settings, wgrad_fusion_kernel_available

    assert not wgrad_fusion_kernel_available()  # no apex on this machine
    assert fusion_settings(True, "cuda")["gradient_accumulation_fusion"] is True
    assert fusion_settings(True, "cpu")["gradient_accumulation_fusion"] is False
    assert fusion_settings(False, "cuda")["gradient_accumulation_fusion"] is False


def _build(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, dict]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    import megatron_patches
    from mcore_agentic.models.deferred_logits import defer_output_layer
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.models.transformer_impl import fusion_settings
    from mcore_agentic.parallel.layout import initialize_parallel
    from tests.unit.models._te_stand_ins import LINEARS, te_stand_ins

    megatron_patches.apply()
    par = ParallelConfig()
    initialize_parallel(par, seed=1234)
    out = {}
    for arch, path in paths.items():
        hf = load_hf_config(path)
        bridge = get_bridge(hf)
        # The TE spec's flags on CUDA; on CPU TransformerConfig refuses TE's fused RoPE, the one that needs TE.
        cuda = {**fusion_settings(True, "cuda"), "apply_rope_fusion": False}
        with te_stand_ins():
            tcfg = bridge.transformer_config(hf, par, use_te=True, **cuda)
            with torch.device("meta"):
                model = bridge.build_model(hf, tcfg, use_te=True)[0]
        te = [m for m in model.modules() if isinstance(m, LINEARS)]
        output = model.output_layer
        out[arch] = {
            "config_fuses": tcfg.gradient_accumulation_fusion,
            "te_linears": len(te),
            "te_fuse": all(m.fuse_wgrad_accumulation for m in te),
            "layers_config_fuses": all(layer.config.gradient_accumulation_fusion for layer in model.decoder.layers),
            "output_layer": f"{type(output).__module__}.{type(output).__name__}",
            "output_is_megatrons": type(output) is ColumnParallelLinear,
            "output_fuses": output.gradient_accumulation_fusion,
            "deferred": defer_output_layer(model),
        }
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("wgrad")
    paths = {arch: str(make_tiny_hf(arch, root / arch, layers=2)) for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")}
    return run_distributed(_build, world_size=1, args=(paths,))[0]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_te_linears_fuse_and_megatrons_output_layer_builds_unfused(built, arch: str) -> None:
    res = built[arch]
    assert res["config_fuses"] is True
    assert res["te_linears"] >= 2 * 2 and res["te_fuse"] and res["layers_config_fuses"]
    # megatron-core's own output layer (not a stand-in), built without apex, on its plain wgrad path ...
    assert res["output_is_megatrons"], res["output_layer"]
    assert res["output_fuses"] is False
    assert res["deferred"] is True  # ... and still deferred by the chunked-logits head


def test_with_apex_the_model_keeps_one_config(monkeypatch) -> None:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mcore_agentic.models import wgrad_fusion

    tcfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, gradient_accumulation_fusion=True)
    spec = ModuleSpec(module=TransformerLayer)
    model_config, layers = wgrad_fusion.split_wgrad_fusion(tcfg, spec)
    assert model_config is not tcfg and model_config.gradient_accumulation_fusion is False
    assert layers.module is wgrad_fusion.OwnConfigLayer and layers.params["layer_config"] is tcfg
    assert tcfg.gradient_accumulation_fusion is True  # the run's config is not touched
    monkeypatch.setattr(wgrad_fusion, "wgrad_fusion_kernel_available", lambda: True)
    assert wgrad_fusion.split_wgrad_fusion(tcfg, spec) == (tcfg, spec)
