"""Logits made a chunk of tokens at a time (``model.logits_chunk_mb``) give the whole logits' numbers.

One spawned group of 2 gloo ranks runs each layout in turn (TP=2, TP=2 with sequence parallelism, CP=2 packed, PP=2,
and tied embeddings at TP=2); per layout an actor is built with the whole logits (``logits_chunk_mb=0``,
megatron-core's output layer) and one with deferred logits cut into chunks of 7 tokens (so every micro-batch spans
many chunks and a row's tokens fall into several). Each runs the old-log-prob pass with entropy, a teacher's top-k
pass, one forward-backward of the PPO objective with an entropy bonus, and a distilling update (candidate log-probs
at the top k, and their gradient); the per-token outputs, the losses, each rank's gradient shards (the output
weight's included) and the update's gradient norm must agree within 1e-6 in fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack

TOL = 1e-6
CHUNK_TOKENS = 7
TOP_K = 4
LENGTHS = [120, 7, 60, 33, 90, 3, 41, 18]

LAYOUTS = {
    # name: (parallel sizes, tied embeddings)
    "tp2": (dict(tensor_model_parallel_size=2), False),
    "tp2_sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True), False),
    "cp2": (dict(context_parallel_size=2), False),
    "pp2": (dict(pipeline_model_parallel_size=2), False),
    "tp2_tied": (dict(tensor_model_parallel_size=2), True),
}


def _run(path: str, par: Any, layout: Any, chunked: bool) -> dict[str, Any]:
    from mcore_agentic.algorithms.config import DistillationConfig, PolicyLossConfig
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig
    from mcore_agentic.workers.passes import dp_share, global_normalisers, log_prob_head
    from tests.unit.workers._fixtures import make_batch

    n = len(LENGTHS)
    cfg = ActorConfig(parallel=par, ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=2,
                      policy_loss=PolicyLossConfig(entropy_coeff=0.01), optim=OptimConfig(lr=1e-4))
    spec = ModelSpec(path, "float32", parallel=par, logits_chunk_mb=1 if chunked else 0)
    actor = Actor(cfg, spec, layout, mini_batch_sequences=n)
    model = actor.model
    deferred = model.logits_chunk_tokens > 0
    if chunked:
        model.logits_chunk_tokens = CHUNK_TOKENS  # 1 MiB would hold every row of this vocabulary at once
    batch = dp_share(make_batch(n, response_lengths=LENGTHS), layout)
    scored = actor.compute_log_prob(batch, calculate_entropy=True)
    top = model.forward_only(batch, log_prob_head(model, actor.temperature, False, top_k=TOP_K), actor.batching)
    norms = global_normalisers(batch["response_mask"], layout)
    model.zero_grad()
    sums = model.forward_backward(scored, log_prob_head(model, actor.temperature, True),
                                   actor._ppo_loss_fn(norms, None), actor.batching)
    grads = [p.main_grad.detach().clone() for chunk in model.chunks for p in chunk.parameters() if p.requires_grad]
    # the deferred layer names no parameter twice (the optimizer's and the checkpoint's names come from here)
    names = [n for chunk in model.chunks for n, _ in chunk.named_parameters(remove_duplicate=False)]
    assert len(names) == len(set(names)) and not any("deferred" in n for n in names), names
    # A distilling update: the student's candidate log-probs at the (here: its own) top k, and their gradient.
    distilled = scored.update({"teacher_top_k_ids": top["top_k_ids"],
                               "teacher_top_k_log_probs": top["top_k_log_probs"] * 0.9})
    update = actor.update_policy(distilled, distillation=DistillationConfig(coef=0.5, top_k=TOP_K))
    return {"deferred": deferred, "log_probs": scored["old_log_probs"], "entropys": scored["entropys"],
            "top_k_log_probs": top["top_k_log_probs"], "top_k_ids": top["top_k_ids"], "sums": sums, "grads": grads,
            "update": {k: update[k] for k in ("pg_loss", "distill_kl", "grad_norm")}}


def _body(rank: int, world_size: int, paths: dict[bool, str]) -> bytes:
    import megatron_patches
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel

    megatron_patches.apply()
    out: dict[str, Any] = {}
    for name, (sizes, tied) in LAYOUTS.items():
        par = ParallelConfig(**sizes)
        layout = initialize_parallel(par, 1)
        out[name] = {"whole": _run(paths[tied], par, layout, False), "chunked": _run(paths[tied], par, layout, True)}
        destroy_parallel()
    return pack(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    from tests.unit.models._hf_fixtures import make_tiny_hf

    root = tmp_path_factory.mktemp("chunked_logits")
    paths = {tied: str(make_tiny_hf("Qwen2ForCausalLM", root / f"tied_{tied}", tied=tied, layers=2))
             for tied in (False, True)}
    return [unpack(r) for r in run_distributed(_body, 2, args=(paths,))]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_logits_equal_the_whole_logits(results, layout):
    assert any(res[layout]["chunked"]["deferred"] for res in results)  # the last stage's ranks
    for rank, res in enumerate(results):
        whole, chunked = res[layout]["whole"], res[layout]["chunked"]
        assert not whole["deferred"]
        for key in ("log_probs", "entropys", "top_k_log_probs"):
            torch.testing.assert_close(chunked[key], whole[key], rtol=TOL, atol=TOL, msg=f"{layout} {rank} {key}")
        assert torch.equal(chunked["top_k_ids"], whole["top_k_ids"])
        assert whole["sums"]["pg_loss"] != 0
        for key, value in whole["sums"].items():
            assert chunked["sums"][key] == pytest.approx(value, rel=TOL, abs=TOL), (layout, rank, key)
        assert whole["update"]["distill_kl"] != 0
        for key, value in whole["update"].items():  # the candidates' gradient is in the grad norm
            assert chunked["update"][key] == pytest.approx(value, rel=TOL, abs=TOL), (layout, rank, key)
        assert len(chunked["grads"]) == len(whole["grads"])
        for i, (got, want) in enumerate(zip(chunked["grads"], whole["grads"], strict=True)):
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * max(want.abs().max().item(), 1e-12),
                                       msg=lambda m, w=f"{layout} rank {rank} grad {i}": f"{w}: {m}")
