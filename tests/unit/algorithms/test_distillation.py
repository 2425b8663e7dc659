"""On-policy distillation's advantage and metrics against hand-computed values: only the student's sampled tokens
carry the teacher's term (tool results and user turns never do), ``add`` and ``only``, the reverse KL by turn index,
and DP replicas that together give the single-batch numbers."""

from __future__ import annotations

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
