"""Actor, reference and critic on 2 gloo ranks: every layout, packed or padded, gives the same results.

One spawned process group runs the layouts one after the other (Megatron's
parallel state is torn down and rebuilt in between: spawning and importing
megatron-core costs more than a layout's whole run); one more single-rank group
runs TP=1 DP=1, the single-process reference. The batch mixes rows of 7 to ~900
tokens. Each DP replica gets its rows as the trainer deals them
(:func:`mcore_agentic.feed.distribute.deal_rows`): an equal, token-balanced share of
every mini-batch. Per layout: old log-probs (+ entropy), reference log-probs, a distillation teacher's
log-probs (a model of another depth and width: 8 layers of hidden 96 against the student's 4 of 64), a PPO
update (two mini-batches, so the second sees ratio != 1; KL loss and entropy bonus
on), reference log-probs again, critic values and two critic updates, an offload
round trip, and full HF weight exports. Layouts differ in packing (THD rows vs padded
rows) and micro-batching (fixed 1, 2, 4, two token budgets), so agreement shows the
update depends on neither.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import (
    global_rows,
    hf_response_log_probs,
    hf_response_top_k,
    make_batch,
    make_tiny_hf,
    make_tiny_teacher,
    setup_rank,
)

TEMPERATURE = 0.7
TOL = 1e-5
TOP_K = 4  # the teacher's top-k next tokens (algorithm.distillation.top_k)
# Adam's first steps are ~lr * sign(grad): float-rounding noise in a near-zero gradient would flip
# whole +-lr updates between layouts. A large eps makes the update proportional to the gradient, so
# layouts can be compared at 1e-5 (the optimizer code path is the same).


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int | None = None
    micro: int = 2
    dynamic: bool = False
    budget: int = 1024
    packed: bool = True
    teacher_tp: int | None = None  # a second teacher with its own split (teacher.tensor_model_parallel_size)


# Response lengths: one row of ~900 tokens among short ones (prompts add 1-6 tokens).
RESPONSE_LENGTHS = [894, 3, 40, 7, 120, 2, 60, 300]
LAYOUTS = {
    "padded_dp2": Layout(micro=2, packed=False),  # the padded path: the baseline the packed one must reproduce
    "tp1_dp2": Layout(micro=2, teacher_tp=2),  # the teacher over both ranks: one block scores both replicas' rows
    "budget_1024": Layout(dynamic=True, budget=1024),
    "budget_4096": Layout(dynamic=True, budget=4096),  # another split into micro-batches, the same update
    "tp2": Layout(tp=2, micro=1, teacher_tp=1),  # the teacher whole on each rank, under the actor's TP=2
    "pp2": Layout(pp=2, dynamic=True, teacher_tp=2),  # both ranks hold the same replica: its rows scored once
    "cp2": Layout(cp=2, micro=4, teacher_tp=2),
    "pp2_vpp2": Layout(pp=2, vpp=2, micro=2),  # interleaved schedule: 1 of the 4 layers per virtual stage
    "pp2_vpp2_budget": Layout(pp=2, vpp=2, dynamic=True, budget=1024),
}
BASE = "padded_dp2"
SINGLE = Layout(micro=2)  # TP=1 on one rank


def _state_snapshot(model) -> list[torch.Tensor]:
    from mcore_agentic.workers.offload import model_param_tensors, optimizer_tensors

    return [t.detach().clone() for t in model_param_tensors(model.chunks) + optimizer_tensors(model.optimizer)]


def _all_layouts(rank: int, world_size: int, path: str, teacher_path: str) -> bytes:
    from mcore_agentic.parallel.layout import destroy_parallel

    out = {}
    layouts = LAYOUTS if world_size == 2 else {"single": SINGLE}
    for name, lay in layouts.items():
        out[name] = _body(path, lay, teacher_path)
        destroy_parallel()
    return _to_bytes(out)


def _global(per_rank: list[dict], key: str) -> torch.Tensor:
    return global_rows(per_rank, key, len(RESPONSE_LENGTHS))


def _body(path: str, lay: Layout, teacher_path: str) -> dict:
    import dataclasses

    from mcore_agentic.algorithms.config import DistillationConfig, PolicyLossConfig, ValueLossConfig
    from mcore_agentic.feed.distribute import deal_rows
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, CriticConfig, OptimConfig, RefConfig, TeacherConfig
    from mcore_agentic.workers.critic import Critic
    from mcore_agentic.workers.reference import Reference
    from mcore_agentic.workers.teacher import Teacher

    t0 = time.time()
    par, layout = setup_rank(lay.tp, lay.pp, lay.cp, vpp=lay.vpp)
    batching = dict(ppo_micro_batch_size_per_gpu=lay.micro, use_dynamic_bsz=lay.dynamic, ppo_max_token_len_per_gpu=lay.budget)
    actor_cfg = ActorConfig(
        parallel=par, ppo_mini_batch_size=4, **batching, optim=OptimConfig(lr=5e-3, eps=1e-3, clip_grad=1.0),
        policy_loss=PolicyLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1),
        param_offload=True, grad_offload=True, optimizer_offload=True,
    )
    spec = ModelSpec(path, "float32", use_remove_padding=lay.packed, temperature=TEMPERATURE, parallel=par)
    actor = Actor(actor_cfg, spec, layout, mini_batch_sequences=4)
    ref_micro = lay.micro if lay.vpp else 3  # VPP needs equal micro-batches
    ref = Reference(RefConfig(log_prob_micro_batch_size_per_gpu=ref_micro, param_offload=True), spec, layout)
    full = make_batch(8, response_lengths=RESPONSE_LENGTHS)
    tokens = full["attention_mask"].sum(1).tolist()
    rows = deal_rows(tokens, chunk=4, dp=layout.data_parallel_size, seed=None)[layout.dp_rank]
    out: dict = {"layout": layout, "rows": rows}
    batch = full.index(rows)
    batch = actor.compute_log_prob(batch, calculate_entropy=True)
    batch = ref.compute_ref_log_prob(batch)
    out["old_log_probs"], out["entropys"] = batch["old_log_probs"], batch["entropys"]
    out["ref_before"] = batch["ref_log_probs"]
    teacher = Teacher(TeacherConfig(log_prob_micro_batch_size_per_gpu=ref_micro, param_offload=True),
                      dataclasses.replace(spec, model_path=teacher_path), layout)
    scored = teacher.compute_teacher_log_prob(batch, top_k=TOP_K)
    out["teacher"] = scored["teacher_log_probs"]
    out["teacher_top_k_log_probs"], out["teacher_top_k_ids"] = scored["teacher_top_k_log_probs"], scored["teacher_top_k_ids"]
    del teacher
    if lay.teacher_tp is not None:  # the same teacher on process groups of its own
        own = Teacher(TeacherConfig(log_prob_micro_batch_size_per_gpu=3, tensor_model_parallel_size=lay.teacher_tp),
                      dataclasses.replace(spec, model_path=teacher_path), layout)
        out["own_layout"] = (own.model.layout.tensor_model_parallel_size, own.model.layout.data_parallel_size,
                             own.model.layout.pipeline_model_parallel_size)
        got = own.compute_teacher_log_prob(batch, top_k=TOP_K)
        out["own_teacher"], out["own_top_k_ids"] = got["teacher_log_probs"], got["teacher_top_k_ids"]
        out["own_top_k_log_probs"] = got["teacher_top_k_log_probs"]
        del own

    out["micro_batches"] = len(actor.model.micro_batches(batch, actor.batching)[0])
    # The update distils too: coef x the top-k KL to the teacher (its gradient through the candidates' log-probs).
    metrics = actor.update_policy(scored, distillation=DistillationConfig(coef=0.5, top_k=TOP_K))
    out["actor_metrics"] = metrics
    # Offload -> reload leaves parameters, DDP buffers and optimizer state bit-identical.
    before = _state_snapshot(actor.model)
    assert actor.offload_before_export() > 0 and actor.offload_after_export() > 0  # the config offloads all three
    assert all(p.untyped_storage().nbytes() == 0 for p in actor.model.chunks[0].parameters())
    actor.reload()
    out["offload_identical"] = all(torch.equal(a, b) for a, b in zip(before, _state_snapshot(actor.model)))
    out["actor_weights"] = actor.export_hf_weights()
    out["ref_after"] = ref.compute_ref_log_prob(batch)["ref_log_probs"]
    out["new_log_probs"] = actor.compute_log_prob(batch)["old_log_probs"]

    if lay.tp == 2:  # SFT step: its loss is the token-mean NLL of the (temperature-1) log-probs
        sft_batch = make_batch(8, seed=3)
        actor.temperature, saved = 1.0, actor.temperature
        out["sft_lp"] = actor.compute_log_prob(sft_batch)["old_log_probs"]
        actor.temperature = saved
        out["sft"] = actor.sft_step(sft_batch)
    del actor, ref

    critic_cfg = CriticConfig(
        ppo_mini_batch_size=8, **batching, optim=OptimConfig(lr=1e-1, eps=1.0), value_loss=ValueLossConfig(cliprange_value=0.2)
    )
    critic = Critic(critic_cfg, spec, layout, mini_batch_sequences=8)
    cbatch = critic.compute_values(batch)
    out["values_init"] = cbatch["values"]
    out["critic_metrics"] = [critic.update_critic(cbatch)]
    cbatch = critic.compute_values(cbatch)
    out["critic_metrics"].append(critic.update_critic(cbatch))
    out["values_after"] = critic.compute_values(cbatch)["values"]
    from tests.helpers.critic import critic_weights

    out["critic_weights"] = critic_weights(critic)
    out["seconds"] = time.time() - t0
    return out


def _to_bytes(obj) -> bytes:
    # Plain bytes through the result queue: many tensors would go through shared-memory file
    # descriptors, which can vanish when the child exits before the parent unpickles them.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    path = str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen2", layers=4, max_positions=1024))
    teacher = str(make_tiny_teacher(tmp_path_factory.mktemp("hf") / "teacher", max_positions=1024))
    per_rank = [torch.load(io.BytesIO(b), weights_only=False)
                for b in run_distributed(_all_layouts, 2, args=(path, teacher))]
    results = {name: [r[name] for r in per_rank] for name in LAYOUTS}
    single = torch.load(io.BytesIO(run_distributed(_all_layouts, 1, args=(path, teacher))[0]), weights_only=False)
    results["single"] = [single["single"]]
    return {"path": path, "teacher": teacher, "results": results}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def test_old_log_probs_match_hf_and_every_layout(runs):
    for name, per_rank in runs["results"].items():
        lay, got = LAYOUTS.get(name, SINGLE), per_rank[0]["layout"]
        sizes = (got.tensor_model_parallel_size, got.pipeline_model_parallel_size, got.context_parallel_size)
        assert sizes == (lay.tp, lay.pp, lay.cp) and got.data_parallel_size == len(per_rank) // (lay.tp * lay.pp * lay.cp)
    batch = make_batch(8, response_lengths=RESPONSE_LENGTHS)
    assert batch["attention_mask"].sum(1).min() <= 8 and batch["attention_mask"].sum(1).max() >= 895
    expected = hf_response_log_probs(runs["path"], batch, TEMPERATURE)
    mask = batch["attention_mask"][:, batch["prompts"].shape[1] :].bool()
    for name, per_rank in runs["results"].items():
        for r in per_rank:  # each rank holds its replica's rows: exactly those
            assert len(r["rows"]) == 8 // r["layout"].data_parallel_size
        got = _global(per_rank, "old_log_probs")
        assert (got - expected).abs().max().item() <= TOL, name
        assert bool((got[~mask] == 0).all())
        # Same weights; the reference's micro-batches differ (3 rows): not bitwise.
        assert (_global(per_rank, "ref_before") - got).abs().max().item() <= TOL, name
    assert expected[mask].abs().min().item() > 1e-3  # real signal


def test_a_teacher_of_another_shape_scores_the_students_rows_at_every_layout(runs):
    """On-policy distillation: the teacher (8 layers of hidden 96 against the student's 4 of 64) gives its HF log-probs
    of the student's response tokens, within 1e-5, at every layout and on one process."""
    batch = make_batch(8, response_lengths=RESPONSE_LENGTHS)
    expected = hf_response_log_probs(runs["teacher"], batch, TEMPERATURE)
    student = hf_response_log_probs(runs["path"], batch, TEMPERATURE)
    mask = batch["attention_mask"][:, batch["prompts"].shape[1] :].bool()
    assert (expected - student)[mask].abs().mean().item() > 0.1  # another model
    for name, per_rank in runs["results"].items():
        got = _global(per_rank, "teacher")
        assert (got - expected).abs().max().item() <= TOL, name
        assert bool((got[~mask] == 0).all())


def test_the_teachers_top_k_match_hf_at_every_layout(runs):
    """``algorithm.distillation.top_k``: the teacher's k most likely next tokens at every response position (ids,
    and their log-probs over the whole vocabulary) equal the HF model's at every layout (tensor-parallel shards'
    candidates merged, pipeline stages, CP halves, packed or padded) within 1e-5."""
    batch = make_batch(8, response_lengths=RESPONSE_LENGTHS)
    expected_lp, expected_ids = hf_response_top_k(runs["teacher"], batch, TEMPERATURE, TOP_K)
    mask = batch["attention_mask"][:, batch["prompts"].shape[1] :].bool()
    for name, per_rank in runs["results"].items():
        ids = _global(per_rank, "teacher_top_k_ids")
        assert ids.dtype == torch.long and ids.shape == (8, mask.shape[1], TOP_K), name
        assert torch.equal(ids[mask], expected_ids[mask]), name
        assert (_global(per_rank, "teacher_top_k_log_probs") - expected_lp).abs().max().item() <= TOL, name
        assert bool((ids[~mask] == 0).all())
    # the first candidate is the teacher's argmax, and its log-prob the highest
    lp = _global(runs["results"][BASE], "teacher_top_k_log_probs")
    assert bool((lp[mask][:, :-1] >= lp[mask][:, 1:]).all())


def test_a_teacher_on_its_own_tensor_parallel_split(runs):
    """``teacher.tensor_model_parallel_size``: a teacher split over TP groups of its own — TP=2 where the actor is
    DP=2 (one block scores both replicas' rows), PP=2 or CP=2 (the teacher is not pipelined or context-split), and
    TP=1 where the actor is TP=2 — gives each rank its replica's rows' HF log-probs and top-k within 1e-5."""
    batch = make_batch(8, response_lengths=RESPONSE_LENGTHS)
    expected = hf_response_log_probs(runs["teacher"], batch, TEMPERATURE)
    expected_lp, expected_ids = hf_response_top_k(runs["teacher"], batch, TEMPERATURE, TOP_K)
    mask = batch["attention_mask"][:, batch["prompts"].shape[1] :].bool()
    checked = 0
    for name, lay in LAYOUTS.items():
        if lay.teacher_tp is None:
            continue
        per_rank = runs["results"][name]
        assert all(r["own_layout"] == (lay.teacher_tp, 2 // lay.teacher_tp, 1) for r in per_rank), name
        assert (_global(per_rank, "own_teacher") - expected).abs().max().item() <= TOL, name
        assert torch.equal(_global(per_rank, "own_top_k_ids")[mask], expected_ids[mask]), name
        assert (_global(per_rank, "own_top_k_log_probs") - expected_lp).abs().max().item() <= TOL, name
        for r in per_rank:  # each rank got exactly its replica's rows, at its own response width
            assert r["own_teacher"].shape == r["teacher"].shape, name
        checked += 1
    assert checked == 4


def test_replicas_get_equal_token_balanced_shares(runs):
    tokens = make_batch(8, response_lengths=RESPONSE_LENGTHS)["attention_mask"].sum(1)
    shares = {tuple(r["rows"]) for r in runs["results"]["tp1_dp2"]}
    assert len(shares) == 2 and sorted(i for s in shares for i in s) == list(range(8))
    # Each mini-batch (rows 0-3, 4-7) split 2 + 2, the 894-token row's partner the lightest one.
    for s in shares:
        assert sum(1 for i in s if i < 4) == 2
    heavy = next(s for s in shares if 0 in s)
    assert int(tokens[list(heavy)].sum()) < int(tokens.sum()) * 0.8


def test_actor_update_is_layout_packing_and_micro_batch_independent(runs):
    base = runs["results"][BASE][0]
    assert base["actor_metrics"]["pg_clipfrac"] > 0 or base["actor_metrics"]["ppo_kl"] != 0
    assert base["actor_metrics"]["lr"] == 5e-3 and base["actor_metrics"]["update_ok"] == 1.0
    assert base["actor_metrics"]["distill_kl"] > 0.01  # the student is another model than its teacher
    base_new = _global(runs["results"][BASE], "new_log_probs")
    for name, per_rank in runs["results"].items():
        for r in per_rank:
            assert r["actor_weights"].keys() == base["actor_weights"].keys()
            for k, w in base["actor_weights"].items():
                assert _rel(r["actor_weights"][k], w) <= TOL, (name, k)
            for k in ("pg_loss", "entropy", "kl_loss", "distill_kl", "grad_norm", "pg_clipfrac", "ppo_kl"):
                assert abs(r["actor_metrics"][k] - base["actor_metrics"][k]) <= TOL * max(1.0, abs(base["actor_metrics"][k])), (name, k)
        assert (_global(per_rank, "new_log_probs") - base_new).abs().max().item() <= 10 * TOL, name
    # The update changed the policy.
    assert (base_new - _global(runs["results"][BASE], "old_log_probs")).abs().max().item() > 1e-3


def test_token_budgets_cut_different_micro_batches(runs):
    counts = {name: runs["results"][name][0]["micro_batches"] for name in ("budget_1024", "budget_4096")}
    assert counts["budget_1024"] > counts["budget_4096"] >= 1, counts
    # Every replica ran the same number (pipeline schedules need it).
    for name in ("budget_1024", "pp2_vpp2_budget"):
        assert len({r["micro_batches"] for r in runs["results"][name]}) == 1


def test_reference_unchanged_by_actor_updates_and_offload_round_trip(runs):
    for name, per_rank in runs["results"].items():
        for r in per_rank:
            assert torch.equal(r["ref_after"], r["ref_before"]), name
            assert r["offload_identical"], name


def test_sft_step_loss_is_masked_token_mean_nll(runs):
    r = runs["results"]["tp2"][0]
    mask = make_batch(8, seed=3)["response_mask"].bool()
    expected = -r["sft_lp"][mask].mean().item()
    assert abs(r["sft"]["sft_loss"] - expected) <= TOL * max(1.0, abs(expected))


def test_critic_values_and_updates_match_across_layouts(runs):
    base = runs["results"][BASE][0]
    assert base["values_init"].abs().max().item() == 0.0  # zero-initialised head
    base_after = _global(runs["results"][BASE], "values_after")
    assert base_after.abs().max().item() > 1e-3
    for name, per_rank in runs["results"].items():
        for r in per_rank:
            assert r["critic_weights"].keys() == base["critic_weights"].keys()
            for k, w in base["critic_weights"].items():
                assert _rel(r["critic_weights"][k], w) <= TOL, (name, k)
            for i, m in enumerate(base["critic_metrics"]):
                assert abs(r["critic_metrics"][i]["vf_loss"] - m["vf_loss"]) <= TOL * max(1.0, m["vf_loss"]), (name, i)
        assert (_global(per_rank, "values_after") - base_after).abs().max().item() <= 10 * TOL, name
    assert "value_head.weight" in base["critic_weights"] and "lm_head.weight" not in base["critic_weights"]
    # The second update moved the body too (the first only the zero head).
    from tests.helpers.hf import load_hf_state_dict

    initial = load_hf_state_dict(runs["path"])
    moved = max(_rel(w, initial[k]) for k, w in base["critic_weights"].items() if k != "value_head.weight")
    assert moved > 1e-4
