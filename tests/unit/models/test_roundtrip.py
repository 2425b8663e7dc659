"""HF -> Megatron -> HF reproduces the checkpoint bit-exactly, and Megatron -> HF -> Megatron too.

One spawn of 2 gloo ranks walks the layouts TP=2, PP=2, PP=2 x VP=2 and TP=1 (DP=2), re-initialising
Megatron's parallel state between them, for a tied (Qwen2) and an untied (Qwen3)
checkpoint (4 layers) whose vocabulary (500) Megatron pads to 512. Per layout and checkpoint:

1. import the HF checkpoint and export it: every HF key, shape and value comes back
   exactly, padding removed, identically on both ranks;
2. perturb every parameter, export, import the export into a fresh model: every
   parameter equals the perturbed one bit-exactly (vocabulary padding rows become 0);
3. an extra HF key, a missing key and a wrong shape are rejected with the key named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import VOCAB, make_tiny_hf, pack, unpack

LAYOUTS = (
    ParallelConfig(tensor_model_parallel_size=2),
    ParallelConfig(pipeline_model_parallel_size=2),
    ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ParallelConfig(),
)


def _real_rows(bridge, name: str, param: torch.Tensor, tp_rank: int) -> slice:
    """Rows of this TP shard that hold real (not padding) vocabulary entries; all rows otherwise."""
    if name not in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return slice(None)
    start = tp_rank * param.shape[0]
    return slice(0, max(0, min(param.shape[0], VOCAB - start)))


def _build(bridge, hf_config, par):
    tcfg = bridge.transformer_config(hf_config, par)
    return bridge.build_model(hf_config, tcfg)


def _roundtrip_body(rank: int, world_size: int, checkpoints: list[str]) -> dict:
    import megatron_patches
    from mcore_agentic.models.bridge import BridgeError
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from tests.helpers.hf import load_hf_state_dict

    megatron_patches.apply()
    out: dict = {}
    for par in LAYOUTS:
        tp_rank = initialize_parallel(par, seed=1234).tp_rank
        for path in checkpoints:
            key = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                   par.virtual_pipeline_model_parallel_size or 1, Path(path).name)
            hf_config = load_hf_config(path)
            bridge = get_bridge(hf_config)
            model_a = _build(bridge, hf_config, par)
            bridge.load_hf_weights(model_a, path)
            exported = dict(bridge.export_hf_weights(model_a))

            # Megatron -> HF -> Megatron with weights no HF checkpoint ever held.
            # Seeded by TP rank: DP replicas stay identical, TP shards differ.
            gen = torch.Generator().manual_seed(99 + tp_rank)
            with torch.no_grad():
                for param in bridge.local_params(model_a).values():
                    param.add_(torch.randn(param.shape, generator=gen))
            # Tied/replicated copies must stay consistent across ranks for a meaningful export: re-sync them
            # the way training keeps them in sync (replicated params are identical on every TP rank).
            _sync_replicated(bridge, model_a)
            perturbed_export = dict(bridge.export_hf_weights(model_a))
            model_b = _build(bridge, hf_config, par)
            bridge.load_hf_weights(model_b, perturbed_export)
            params_a, params_b = bridge.local_params(model_a), bridge.local_params(model_b)
            assert params_a.keys() == params_b.keys()
            mismatched = []
            for name, pa in params_a.items():
                rows = _real_rows(bridge, name, pa, tp_rank)
                if not torch.equal(pa[rows], params_b[name][rows]):
                    mismatched.append(name)
                if rows != slice(None) and params_b[name][rows.stop :].abs().sum() != 0:
                    mismatched.append(name + " (padding rows not zero)")

            errors = {}
            state = load_hf_state_dict(path)
            for label, bad_state in (
                ("extra", {**state, "model.layers.0.self_attn.rotary_bias": torch.zeros(2)}),
                ("missing", {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}),
                ("shape", {**state, "model.norm.weight": torch.ones(3)}),
            ):
                try:
                    bridge.load_hf_weights(_build(bridge, hf_config, par), bad_state)
                    errors[label] = None
                except BridgeError as exc:
                    errors[label] = str(exc)
            out[key] = {"exported": exported, "perturbed_export": perturbed_export, "mismatched": mismatched,
                        "errors": errors, "local_names": sorted(params_a)}
        destroy_parallel()
    return pack(out)


def _sync_replicated(bridge, chunks) -> None:
    """Average TP-replicated parameters over the TP group and tie the PP embedding copies (as training does)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    for name, param in bridge.local_params(chunks).items():
        if bridge.tp_split_dim(name) is None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(param.data, group=tp_group)
            param.data /= dist.get_world_size(tp_group)
    if ps.get_pipeline_model_parallel_world_size() > 1 and bridge.hf_config.tie_word_embeddings:
        # The first chunk embeds on the first stage; the last chunk holds the output copy on the last stage.
        weight = (chunks[-1] if ps.is_pipeline_last_stage() else chunks[0]).shared_embedding_or_output_weight()
        if ps.is_pipeline_last_stage():
            weight.data.zero_()
        dist.all_reduce(weight.data, group=ps.get_embedding_group())


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    from tests.helpers.hf import load_hf_state_dict

    root = tmp_path_factory.mktemp("rt")
    paths = [
        make_tiny_hf("Qwen2ForCausalLM", root / "qwen2_tied", tied=True, layers=4, seed=1),
        make_tiny_hf("Qwen3ForCausalLM", root / "qwen3_untied", tied=False, layers=4, seed=2),
    ]
    per_rank = [unpack(r) for r in run_distributed(_roundtrip_body, world_size=2, args=([str(p) for p in paths],))]
    return per_rank, {p.name: load_hf_state_dict(p) for p in paths}


CASES = [(tp, pp, vp, name) for tp, pp, vp in ((2, 1, 1), (1, 2, 1), (1, 2, 2), (1, 1, 1))
         for name in ("qwen2_tied", "qwen3_untied")]
IDS = [f"tp{t}_pp{p}_vp{v}_{n}" for t, p, v, n in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hf_import_export_is_exact(case, results) -> None:
    per_rank, hf_states = results
    hf = hf_states[case[3]]
    if case[3] == "qwen2_tied":
        assert "lm_head.weight" not in hf  # the tied checkpoint stores only the embedding
    for rank in (0, 1):
        exported = per_rank[rank][case]["exported"]
        assert exported.keys() == hf.keys(), (rank, sorted(exported.keys() ^ hf.keys()))
        for name, tensor in hf.items():
            assert exported[name].shape == tensor.shape, name  # vocabulary padding removed
            assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_megatron_export_import_is_exact(case, results) -> None:
    per_rank, hf_states = results
    r0, r1 = per_rank[0][case], per_rank[1][case]
    assert r0["mismatched"] == [] and r1["mismatched"] == []
    # The export is identical on every rank and differs from the original checkpoint (perturbed).
    for name, tensor in r0["perturbed_export"].items():
        assert torch.equal(tensor, r1["perturbed_export"][name]), name
        assert not torch.equal(tensor, hf_states[case[3]][name]), name
    _, pp, vp, _ = case
    if pp == 2:  # each stage holds its layers renumbered to global indices: [0,1 | 2,3], or [0,2 | 1,3] with VP=2
        stage0 = {int(n.split(".")[2]) for n in r0["local_names"] if n.startswith("decoder.layers.")}
        stage1 = {int(n.split(".")[2]) for n in r1["local_names"] if n.startswith("decoder.layers.")}
        assert (stage0, stage1) == (({0, 1}, {2, 3}) if vp == 1 else ({0, 2}, {1, 3}))
    if case[3] == "qwen2_tied" and pp == 2:
        assert "output_layer.weight" in r1["local_names"]  # the last stage's copy of the tied embedding


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bad_checkpoints_are_rejected_by_key(case, results) -> None:
    per_rank, _ = results
    # Every rank raises (with PP=2 the stage that found the problem tells the other one).
    for rank in (0, 1):
        errors = per_rank[rank][case]["errors"]
        assert errors["extra"] is not None and "model.layers.0.self_attn.rotary_bias" in errors["extra"]
        assert errors["shape"] is not None and "model.norm.weight" in errors["shape"]
        assert errors["missing"] is not None and "model.layers.1.mlp.up_proj.weight" in errors["missing"]
