"""The critic under sequence parallelism (2 gloo ranks): TP=2 + SP gives TP=1's values and updates.

Megatron's vocabulary output layer all-gathers the SP-scattered hidden states; the critic's value head replaces
it and must do the same, or values cover ``s / tp`` tokens per rank. On CPU the local spec runs SP (its norms are
:class:`LocalRMSNorm`); the run-level rule that refuses SP on CPU is bypassed here by building the workers with an
SP ``ParallelConfig`` over TP=2 process groups.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import global_rows, make_batch, make_tiny_hf, setup_rank

TOL = 1e-5
RESPONSE_LENGTHS = [37, 3, 12, 7, 20, 2, 9, 15]  # odd lengths: rows are padded to a multiple of TP under SP
LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "tp2_sp": (2, True)}


def _body(path: str, tp: int, sp: bool) -> dict:
    from mcore_agentic.algorithms.config import ValueLossConfig
    from mcore_agentic.feed.distribute import deal_rows
    from mcore_agentic.models.bridge import unwrap_model
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, CriticConfig, OptimConfig
    from mcore_agentic.workers.critic import Critic
    from tests.helpers.critic import critic_weights

    par, layout = setup_rank(tp)
    par = dataclasses.replace(par, sequence_parallel=sp)
    full = make_batch(8, response_lengths=RESPONSE_LENGTHS)
    rows = deal_rows(full["attention_mask"].sum(1).tolist(), chunk=8, dp=layout.data_parallel_size, seed=None)
    batch = full.index(rows[layout.dp_rank])
    out: dict = {"rows": rows[layout.dp_rank]}
    spec = ModelSpec(path, "float32", temperature=1.0, parallel=par)

    actor_cfg = ActorConfig(parallel=par, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2)
    actor = Actor(actor_cfg, spec, layout, mini_batch_sequences=8)
    out["log_probs"] = actor.compute_log_prob(batch)["old_log_probs"]
    del actor

    cfg = CriticConfig(
        ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-1, eps=1.0),
        value_loss=ValueLossConfig(cliprange_value=0.2),
    )
    critic = Critic(cfg, spec, layout, mini_batch_sequences=8)
    head = unwrap_model(critic.model.chunks[-1]).output_layer
    out["head_sequence_parallel"] = head.sequence_parallel
    saved = head.weight.detach().clone()
    with torch.no_grad():  # a non-zero head, the same on every rank, for a forward that says something
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(7)))
    out["values"] = critic.compute_values(batch)["values"]
    padded = Critic(cfg, dataclasses.replace(spec, use_remove_padding=False), layout, mini_batch_sequences=8)
    with torch.no_grad():
        unwrap_model(padded.model.chunks[-1]).output_layer.weight.copy_(head.weight)
    out["values_padded"] = padded.compute_values(batch)["values"]
    del padded
    with torch.no_grad():
        head.weight.copy_(saved)
    # Two updates: the first moves only the zero head, the second the body too (the gather's backward, the
    # norms' gradients all-reduced over TP under SP).
    cbatch = critic.compute_values(batch)
    out["metrics"] = [critic.update_critic(cbatch)]
    cbatch = critic.compute_values(cbatch)
    out["metrics"].append(critic.update_critic(cbatch))
    out["values_after"] = critic.compute_values(cbatch)["values"]
    out["weights"] = critic_weights(critic)
    return out


def _all_layouts(rank: int, world_size: int, path: str) -> bytes:
    from mcore_agentic.parallel.layout import destroy_parallel

    out = {}
    for name, (tp, sp) in LAYOUTS.items():
        out[name] = _body(path, tp, sp)
        destroy_parallel()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    path = str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen2", layers=2))
    per_rank = [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_all_layouts, 2, args=(path,))]
    return {name: [r[name] for r in per_rank] for name in LAYOUTS}


def _global(per_rank: list[dict], key: str) -> torch.Tensor:
    return global_rows(per_rank, key, len(RESPONSE_LENGTHS))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def test_value_head_gathers_under_sequence_parallelism(runs):
    assert [r["head_sequence_parallel"] for r in runs["tp2_sp"]] == [True, True]
    assert not any(r["head_sequence_parallel"] for r in runs["tp1"] + runs["tp2"])
    base = _global(runs["tp1"], "values")
    mask = make_batch(8, response_lengths=RESPONSE_LENGTHS)["attention_mask"][:, -base.shape[1]:].bool()
    assert base.shape == mask.shape and base[mask].abs().min().item() > 0  # every response token has a value
    for name in ("tp2", "tp2_sp"):
        for key in ("values", "values_padded"):
            assert _rel(_global(runs[name], key), base) <= TOL, (name, key)
    # The local spec's SP path itself: the actor's log-probs (its output layer gathers) agree too.
    lp = _global(runs["tp1"], "log_probs")
    assert _rel(_global(runs["tp2_sp"], "log_probs"), lp) <= TOL


def test_critic_updates_under_sequence_parallelism_match_tp1(runs):
    base = runs["tp1"][0]
    base_after = _global(runs["tp1"], "values_after")
    assert base_after.abs().max().item() > 1e-3
    for r in runs["tp2_sp"]:
        assert r["weights"].keys() == base["weights"].keys()
        for k, w in base["weights"].items():
            assert _rel(r["weights"][k], w) <= TOL, k
        for i, m in enumerate(base["metrics"]):
            assert abs(r["metrics"][i]["vf_loss"] - m["vf_loss"]) <= TOL * max(1.0, m["vf_loss"]), i
    assert _rel(_global(runs["tp2_sp"], "values_after"), base_after) <= TOL
