"""The planner's activation estimate against the tensors autograd really saves in an actor update on CPU.

Measurement (exact on CPU): a ``saved_tensors_hooks`` pack hook sees every tensor autograd keeps for the
backward pass of one micro-batch (the actor's PPO update, one micro-batch per step); the bytes of their distinct
storages, parameters excluded, when the backward pass starts (the first unpack: selective recomputation of the norms
frees their outputs after they were saved) are the micro-batch's activation memory. The estimate
(:func:`mcore_agentic.plan.activations.saved_bytes`) must be within ``TOLERANCE`` of it, for dense and MoE
models, eager and fused attention, one rank and TP=2, with each activation-recomputation mode
(``actor.recompute_*``): full uniform and block, selective with each module, and with the logits chunked (the
default: none kept) or whole (``model.logits_chunk_mb=0``).
"""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.models.spec import logits_chunk_tokens
from mcore_agentic.plan.activations import Dims, Recompute, Split, saved_bytes
from mcore_agentic.workers.config import RecomputeConfig
from tests.helpers.distributed import run_distributed

TOLERANCE = 0.05
LENGTHS = [300, 40, 120, 7]  # response tokens per row (prompts add 1-6)

CASES = {
    # name: (arch, hidden, ffn, heads, kv_heads, layers, fused, tp, recompute)
    "dense_fused": ("qwen2", 64, 128, 4, 2, 2, True, 1, {}),
    "dense_fused_whole_logits": ("qwen2", 64, 128, 4, 2, 2, True, 1, {"logits_chunk_mb": 0}),
    "dense_eager": ("qwen2", 64, 128, 4, 2, 2, False, 1, {}),
    "wide_fused": ("qwen2", 128, 384, 4, 2, 3, True, 1, {}),
    "moe_fused": ("qwen3_moe", 64, 128, 4, 2, 2, True, 1, {}),
    "dense_tp2_fused": ("qwen2", 64, 128, 4, 2, 2, True, 2, {}),
    "full_uniform": ("qwen2", 128, 384, 4, 2, 4, True, 1, {"recompute_granularity": "full"}),
    "full_uniform_2": ("qwen2", 128, 384, 4, 2, 4, True, 1,
                       {"recompute_granularity": "full", "recompute_num_layers": 2}),
    "full_block": ("qwen2", 128, 384, 4, 2, 4, True, 1,
                   {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}),
    "selective_dense": ("qwen2", 128, 384, 4, 2, 4, True, 1,
                        {"recompute_granularity": "selective", "recompute_modules": ("core_attn", "layernorm", "mlp")}),
    "selective_core_attn_eager": ("qwen2", 64, 128, 4, 2, 2, False, 1, {"recompute_granularity": "selective"}),
    "selective_moe": ("qwen3_moe", 64, 128, 4, 2, 2, True, 1,
                      {"recompute_granularity": "selective", "recompute_modules": ("moe",)}),
}


def _measure_all(rank: int, world_size: int, cases: list[tuple[str, bool, int, dict]]) -> list[tuple[list[int], int]]:
    """Each case (checkpoint, fused, TP, recompute) in turn in this one spawned group (Megatron's state rebuilt
    between)."""
    from mcore_agentic.parallel.layout import destroy_parallel

    out = []
    for path, fused, tp, recompute in cases:
        out.append(_measure(path, fused, tp, recompute))
        destroy_parallel()
    return out


def _measure(path: str, fused: bool, tp: int, settings: dict) -> tuple[list[int], int]:
    import megatron_patches
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import initialize_parallel
    from mcore_agentic.parallel.local_attention import LocalDotProductAttention
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig, RecomputeConfig
    from tests.unit.workers._fixtures import make_batch

    megatron_patches.apply()
    LocalDotProductAttention.fused_devices = ("cuda", "cpu") if fused else ("cuda",)
    par = ParallelConfig(tensor_model_parallel_size=tp)
    layout = initialize_parallel(par, 1)
    n = len(LENGTHS)
    actor = Actor(ActorConfig(parallel=par, ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=n,
                              optim=OptimConfig(lr=1e-4), recompute=RecomputeConfig(**_recompute(settings))),
                  ModelSpec(path, "float32", parallel=par, logits_chunk_mb=settings.get("logits_chunk_mb", 256)),
                  layout, mini_batch_sequences=n)
    batch = actor.compute_log_prob(make_batch(n, response_lengths=LENGTHS))
    params = {p.untyped_storage().data_ptr() for c in actor.model.chunks for p in c.parameters()}
    seen: dict[int, torch.UntypedStorage] = {}
    at_backward: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and torch._C._current_graph_task_id() == -1:  # not a recomputation
            seen[storage.data_ptr()] = storage
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if not at_backward:  # the backward pass starts: what the forward pass left saved, at its size now
            at_backward.append(sum(s.nbytes() for s in seen.values()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        actor.update_policy(batch)
    return batch["attention_mask"].sum(1).tolist(), at_backward[0]


def _recompute(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k.startswith("recompute_")}


def _checkpoint(root, arch: str, hidden: int, ffn: int, heads: int, kv: int, layers: int) -> tuple[str, Dims]:
    import transformers

    from tests.helpers.hf import tiny_qwen2_config
    from tests.unit.workers._fixtures import VOCAB

    config = tiny_qwen2_config(vocab=VOCAB, layers=layers, max_positions=1024)
    config.hidden_size, config.intermediate_size = hidden, ffn
    config.num_attention_heads, config.num_key_value_heads = heads, kv
    model_cls = transformers.Qwen2ForCausalLM
    experts = top_k = expert_ffn = 0
    if arch == "qwen3_moe":
        experts, top_k, expert_ffn = 8, 2, 32
        config = transformers.Qwen3MoeConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"},
                                             head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=top_k,
                                             moe_intermediate_size=expert_ffn, norm_topk_prob=True)
        config.architectures = ["Qwen3MoeForCausalLM"]
        model_cls = transformers.Qwen3MoeForCausalLM
    path = root
    model_cls(config).save_pretrained(str(path))
    padded = -(-VOCAB // 128) * 128
    dims = Dims(hidden=hidden, heads=heads, kv_heads=kv, head_dim=hidden // heads, ffn=ffn, layers=layers,
                vocab=padded, experts=experts, top_k=top_k, expert_ffn=expert_ffn,
                moe_layers=layers if experts else 0, qk_norm=bool(experts))
    return str(path), dims


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, tuple[Dims, list[int], int]]:
    """Every case measured: one spawned group per world size."""
    root = tmp_path_factory.mktemp("activations")
    made = {name: _checkpoint(root / name, *CASES[name][:6]) for name in CASES}  # (cheap: tiny models)
    out = {}
    for world in sorted({case[7] for case in CASES.values()}):  # one spawned group per world size
        names = [name for name, case in CASES.items() if case[7] == world]
        results = run_distributed(_measure_all, world, args=([(made[n][0], CASES[n][6], world, CASES[n][8])
                                                               for n in names],))[0]
        for name, (rows, nbytes) in zip(names, results, strict=True):
            out[name] = (made[name][1], rows, nbytes)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_saved_activation_estimate_within_tolerance(case, measured):
    *_, layers, fused, tp, settings = CASES[case]
    dims, rows, nbytes = measured[case]
    if tp > 1:
        dims = Dims(**{**dims.__dict__, "vocab": -(-dims.vocab // (128 * tp)) * 128 * tp})
    chunk_mb = settings.get("logits_chunk_mb", 256)  # the default: chunked logits, none kept for the backward pass
    split = Split(tp=tp, fused_attention=fused, dtype_bytes=4,
                  logits_chunk_tokens=logits_chunk_tokens(chunk_mb, dims.vocab // tp))
    estimate = saved_bytes(dims, split, rows, layers=layers, last_stage=True,
                           recompute=Recompute.of(RecomputeConfig(**_recompute(settings))))
    assert abs(estimate - nbytes) <= TOLERANCE * nbytes, (case, estimate, nbytes, estimate / nbytes)
