"""On-policy distillation's advantage and metrics against hand-computed values: only the student's sampled tokens
carry the teacher's term (tool results and user turns never do), ``add`` and ``only``, the reverse KL by turn index,
and DP replicas that together give the single-batch numbers."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_agentic.algorithms.config import AlgorithmConfig, DistillationConfig
from mcore_agentic.algorithms.distillation import distillation_advantages, distillation_metrics
from mcore_agentic.utils.errors import ConfigError

# Row 0: turn 0 (2 sampled tokens), a tool result (2 environment tokens), turn 1 (1 sampled), padding.
# Row 1: one turn of 3 sampled tokens, then a user turn (1 environment token), padding.
MASK = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
STUDENT = torch.tensor([[-1.0, -2.0, -9.0, -9.0, -0.5, 0.0], [-0.1, -0.2, -0.3, -7.0, 0.0, 0.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -1.0, -1.0, -0.5, 0.0], [-0.4, -0.2, -1.3, -0.1, 0.0, 0.0]])
TASK = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5, 0.0], [-1.0, -1.0, -1.0, -1.0, 0.0, 0.0]])


def test_the_teacher_term_sits_on_sampled_tokens_only():
    only = distillation_advantages(TASK, STUDENT, TEACHER, MASK, mode="only", coef=2.0)
    # 2 * (teacher - student) where the student sampled; the tool and user tokens (teacher disagrees there) get 0
    assert torch.allclose(only, torch.tensor([[-1.0, 2.0, 0.0, 0.0, 0.0, 0.0], [-0.6, 0.0, -2.0, 0.0, 0.0, 0.0]]))
    added = distillation_advantages(TASK, STUDENT, TEACHER, MASK, mode="add", coef=0.5)
    assert torch.allclose(added, torch.tensor([[0.25, 1.0, 0.0, 0.0, 0.5, 0.0], [-1.15, -1.0, -1.5, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="add or only"):
        distillation_advantages(TASK, STUDENT, TEACHER, MASK, mode="replace", coef=1.0)


def test_a_student_equal_to_its_teacher_gets_the_task_advantage_alone():
    assert torch.equal(distillation_advantages(TASK, STUDENT, STUDENT, MASK, mode="add", coef=3.0), TASK * MASK)
    assert not distillation_advantages(TASK, STUDENT, STUDENT, MASK, mode="only", coef=3.0).any()


def test_reverse_kl_metrics_by_turn_and_over_replicas():
    m = distillation_metrics(STUDENT, TEACHER, MASK)
    # per-token student - teacher: row 0 turn 0 [0.5, -1.0], turn 1 [0.0]; row 1 turn 0 [0.3, 0.0, 1.0]
    assert m["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0 + 0.3 + 0.0 + 1.0) / 6)
    assert m["distill/reverse_kl/turn_0"] == pytest.approx((0.5 - 1.0 + 0.3 + 0.0 + 1.0) / 5)
    assert m["distill/reverse_kl/turn_1"] == pytest.approx(0.0)
    assert "distill/reverse_kl/turn_2" not in m
    # a forked agent episode's later sample counts its turns from its offset
    shifted = distillation_metrics(STUDENT, TEACHER, MASK, turn_offset=torch.tensor([0, 1]))
    assert shifted["distill/reverse_kl/turn_1"] == pytest.approx((0.0 + 0.3 + 0.0 + 1.0) / 4)

    # two DP replicas, one row each, summed by the reducer: the single-batch numbers
    parts = [distillation_metrics(STUDENT[i : i + 1], TEACHER[i : i + 1], MASK[i : i + 1], reduce=None) for i in range(2)]
    assert parts[0] != m
    collected: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        collected.append(t)
        return t

    for i in range(2):
        distillation_metrics(STUDENT[i : i + 1], TEACHER[i : i + 1], MASK[i : i + 1], reduce=record)
    total = collected[0] + collected[1]
    assert distillation_metrics(STUDENT, TEACHER, MASK, reduce=lambda t: total) == pytest.approx(m)
    assert distillation_metrics(STUDENT, TEACHER, torch.zeros_like(MASK)) == {}


def test_config_is_checked():
    with pytest.raises(ConfigError) as info:
        DistillationConfig(mode="replace")
    assert info.value.field == "algorithm.distillation.mode"
    with pytest.raises(ConfigError) as info:
        DistillationConfig(coef=0.0)
    assert info.value.field == "algorithm.distillation.coef"
    cfg = AlgorithmConfig(adv_estimator="grpo", distillation={"mode": "only", "coef": 0.5})
    assert cfg.distillation == DistillationConfig(mode="only", coef=0.5)


def test_the_experience_adds_the_term_to_the_estimators_advantages():
    """``compute_experience`` with a teacher's log-probs in the batch: GRPO's advantages plus the term (``add``), the
    term alone (``only``), and the reverse-KL metrics."""
    from mcore_agentic.data.batch import Batch
    from mcore_agentic.trainer.experience import compute_experience

    tensors = {"response_mask": MASK, "old_log_probs": STUDENT, "seq_scores": torch.tensor([1.0, 0.0])}
    plain, plain_metrics = compute_experience(Batch(tensors=tensors, meta={"uid": ["a", "a"]}),
                                              AlgorithmConfig(adv_estimator="grpo"), None)
    assert plain["advantages"][0, 0] > 0 > plain["advantages"][1, 0] and "distill/reverse_kl" not in plain_metrics
    batch = Batch(tensors={**tensors, "teacher_log_probs": TEACHER}, meta={"uid": ["a", "a"]})
    for mode, coef in (("add", 0.5), ("only", 2.0)):
        algo = AlgorithmConfig(adv_estimator="grpo", distillation=DistillationConfig(mode=mode, coef=coef))
        out, metrics = compute_experience(batch, algo, None)
        task = plain["advantages"] if mode == "add" else torch.zeros_like(plain["advantages"])
        expected = (task + coef * (TEACHER - STUDENT)) * MASK
        assert torch.allclose(out["advantages"], expected.float(), atol=1e-6), mode
        assert metrics["distill/reverse_kl"] == pytest.approx(0.8 / 6)
        assert metrics["distill/reverse_kl/turn_1"] == pytest.approx(0.0)


# --------------------------------------------------------------------------------------------- top-k
def _lp(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_top_k_kl_by_hand():
    """The KL over the teacher's top k and one bucket for the rest, against hand arithmetic."""
    from mcore_agentic.algorithms.distillation import top_k_kl

    teacher, student = _lp(0.6, 0.3), _lp(0.2, 0.5)  # tails 0.1 and 0.3
    forward = 0.6 * math.log(0.6 / 0.2) + 0.3 * math.log(0.3 / 0.5) + 0.1 * math.log(0.1 / 0.3)
    reverse = 0.2 * math.log(0.2 / 0.6) + 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.1)
    assert float(top_k_kl(student, teacher, direction="forward")) == pytest.approx(forward, rel=1e-5)
    assert float(top_k_kl(student, teacher, direction="reverse")) == pytest.approx(reverse, rel=1e-5)
    assert float(top_k_kl(teacher, teacher, direction="forward")) == pytest.approx(0.0, abs=1e-7)
    # A teacher with all its mass in the top k: the tail term is the student's mass outside them, nothing else.
    full, spread = _lp(0.75, 0.25), _lp(0.5, 0.25)
    assert float(top_k_kl(spread, full, direction="forward")) == pytest.approx(0.75 * math.log(1.5), rel=1e-5)
    assert torch.isfinite(top_k_kl(full, full, direction="reverse")).all()
    with pytest.raises(ValueError, match="direction"):
        top_k_kl(student, teacher, direction="jsd")


def test_top_k_kl_gradient_pulls_the_student_to_the_teacher():
    """Forward KL's gradient in the student's log-probs of the candidates: ``-(pT_i - pS_i * pT_tail / pS_tail)``,
    the teacher's most likely token pulled up hardest."""
    from mcore_agentic.algorithms.distillation import top_k_kl

    teacher = _lp(0.7, 0.2)
    student = _lp(0.1, 0.3).requires_grad_(True)
    top_k_kl(student, teacher, direction="forward").backward()
    ps, pt_tail, ps_tail = torch.tensor([0.1, 0.3]), 0.1, 0.6
    expected = -(torch.tensor([0.7, 0.2]) - ps * pt_tail / ps_tail)
    assert torch.allclose(student.grad.float(), expected, atol=1e-6)
    assert student.grad[0] < student.grad[1] < 0


def test_with_top_k_the_advantage_is_the_tasks_or_none():
    """``top_k`` moves the teacher's signal into the loss: ``add`` keeps the task advantage on sampled tokens,
    ``only`` leaves no policy gradient."""
    add = distillation_advantages(TASK, STUDENT, TEACHER, MASK, mode="add", coef=2.0, top_k=8)
    assert torch.equal(add, TASK * MASK)
    assert not distillation_advantages(TASK, STUDENT, TEACHER, MASK, mode="only", coef=2.0, top_k=8).any()
    with pytest.raises(ConfigError) as info:
        DistillationConfig(top_k=-1)
    assert info.value.field == "algorithm.distillation.top_k"
    with pytest.raises(ConfigError) as info:
        DistillationConfig(kl="jsd")
    assert info.value.field == "algorithm.distillation.kl"


def test_the_top_k_term_is_masked_like_every_loss_term():
    """The actor objective's ``distill_kl``: the token mean of the top-k KL over the sampled tokens only (tool and
    user tokens, where the teacher's numbers are arbitrary, add nothing), weighted by ``coef``."""
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.algorithms.distillation import top_k_kl
    from mcore_agentic.algorithms.losses import loss_normalisers
    from mcore_agentic.algorithms.objective import TopKDistillation, actor_objective

    gen = torch.Generator().manual_seed(0)
    b, r, k = MASK.shape[0], MASK.shape[1], 3
    student = torch.log_softmax(torch.randn(b, r, 10, generator=gen), -1)[..., :k]
    teacher = torch.log_softmax(torch.randn(b, r, 10, generator=gen), -1)[..., :k]
    teacher[MASK == 0] = 0.0  # environment tokens: whatever the teacher said there must not count
    zeros = torch.zeros(b, r)
    args = dict(old_log_probs=STUDENT, log_probs=STUDENT, entropys=zeros, advantages=zeros, response_mask=MASK)
    norms = loss_normalisers(MASK)
    plain = actor_objective(PolicyLossConfig(), norms, **args)
    out = actor_objective(PolicyLossConfig(), norms, **args, distill=TopKDistillation(
        coef=0.5, direction="forward", student_log_probs=student, teacher_log_probs=teacher))
    expected = top_k_kl(student, teacher, direction="forward")[MASK.bool()].mean()
    assert float(out.metrics["distill_kl"]) == pytest.approx(float(expected), rel=1e-6)
    assert float(out.loss - plain.loss) == pytest.approx(0.5 * float(expected), rel=1e-6)
