"""A mixture-of-experts distillation teacher beside a dense student, on 2 gloo ranks: split like the actor (TP=2; its
experts whole on each rank, expert TP 1) and on its own TP=2 groups beside an actor at DP=2, its log-probs and
top-k of the student's rows equal the HF Qwen3-MoE's within 1e-5."""

from __future__ import annotations

import io

import torch

from tests.helpers.distributed import run_distributed
from tests.unit.models._hf_fixtures import make_tiny_hf as make_tiny_arch
from tests.unit.workers._fixtures import (
    global_rows,
    hf_response_log_probs,
    hf_response_top_k,
    make_batch,
    make_tiny_hf,
    setup_rank,
)

TEMPERATURE = 0.8
TOP_K = 3
TOL = 1e-5


def _body(rank: int, world_size: int, student: str, teacher: str) -> bytes:
    import dataclasses

    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.layout import destroy_parallel
    from mcore_agentic.workers.config import TeacherConfig
    from mcore_agentic.workers.teacher import Teacher

    out = {}
    for name, tp, own in (("actor_tp2", 2, None), ("own_tp2", 1, 2)):
        par, layout = setup_rank(tp)
        spec = ModelSpec(student, "float32", temperature=TEMPERATURE, parallel=par)
        batch = make_batch(8)
        rows = list(range(8)) if layout.data_parallel_size == 1 else list(range(layout.dp_rank * 4, layout.dp_rank * 4 + 4))
        teacher_model = Teacher(TeacherConfig(log_prob_micro_batch_size_per_gpu=3, tensor_model_parallel_size=own),
                        dataclasses.replace(spec, model_path=teacher), layout)
        assert teacher_model.model.is_moe
        got = teacher_model.compute_teacher_log_prob(batch.index(rows), top_k=TOP_K)
        out[name] = {"rows": rows, **{k: got[k] for k in ("teacher_log_probs", "teacher_top_k_log_probs",
                                                            "teacher_top_k_ids")}}
        del teacher_model
        destroy_parallel()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def test_a_mixture_of_experts_teacher_scores_a_dense_students_rows(tmp_path):
    student = str(make_tiny_hf(tmp_path / "student"))
    teacher = str(make_tiny_arch("Qwen3MoeForCausalLM", tmp_path / "moe_teacher"))
    per_rank = [torch.load(io.BytesIO(b), weights_only=False)
                for b in run_distributed(_body, 2, args=(student, teacher))]
    batch = make_batch(8)
    expected = hf_response_log_probs(teacher, batch, TEMPERATURE)
    expected_lp, expected_ids = hf_response_top_k(teacher, batch, TEMPERATURE, TOP_K)
    mask = batch["attention_mask"][:, batch["prompts"].shape[1] :].bool()
    assert (expected - hf_response_log_probs(student, batch, TEMPERATURE))[mask].abs().mean() > 0.1  # another model
    for name in ("actor_tp2", "own_tp2"):
        results = [r[name] for r in per_rank]
        assert (global_rows(results, "teacher_log_probs", 8) - expected).abs().max().item() <= TOL, name
        assert (global_rows(results, "teacher_top_k_log_probs", 8) - expected_lp).abs().max().item() <= TOL, name
        assert torch.equal(global_rows(results, "teacher_top_k_ids", 8)[mask], expected_ids[mask]), name
