"""On-policy distillation: a teacher's per-token signal on the tokens the student sampled (``algorithm.distillation``).

The student samples a trajectory; a frozen teacher scores each *sampled* token. The per-token advantage is

    A_t = coef * (log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t))

the negative of the sampled token's contribution to the reverse KL ``KL(student || teacher)``, whose expectation
over the student's own samples is the reverse KL (a mode-seeking target the student can reach by its own
actions). ``log p_student`` is the trainer's log-prob of the token under the weights that sampled it (the batch's
``old_log_probs``): the term is a fixed per-token reward, not differentiated. Only tokens in the loss mask carry
it — tool results, user turns and the chat template's tokens between turns are the environment's, not the
student's actions, and get nothing — so a multi-turn trajectory is distilled exactly where the student acted.

``mode``: ``add`` adds ``A_t`` to the task advantage of the configured estimator (task reward and teacher
together); ``only`` makes it the whole advantage (pure distillation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_agentic.algorithms.advantages import TURN_METRIC_TURNS, turn_index

__all__ = ["distillation_advantages", "distillation_metrics", "reverse_kl_per_token"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


def reverse_kl_per_token(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log p_student - log p_teacher`` on the sampled tokens (``mask`` 1), 0 elsewhere: each token's sample of the
    reverse KL."""
    diff = student_log_probs.float() - teacher_log_probs.float()
    return torch.where(mask.bool(), diff, torch.zeros((), dtype=diff.dtype))


def distillation_advantages(
    advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor,
    *, mode: str, coef: float,
) -> torch.Tensor:
    """The advantages with the teacher's term: ``advantages + coef * (lp_T - lp_S)`` (``add``) or the term alone
    (``only``), on sampled tokens; 0 on every other token."""
    term = -coef * reverse_kl_per_token(student_log_probs, teacher_log_probs, mask)
    if mode == "only":
        return term.to(advantages.dtype)
    if mode != "add":
        raise ValueError(f"mode must be add or only, got {mode!r}")
    return (torch.where(mask.bool(), advantages, torch.zeros((), dtype=advantages.dtype)) + term).to(advantages.dtype)


def distillation_metrics(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor, *,
    reduce: Reduce | None = None, turns: int = TURN_METRIC_TURNS, turn_offset: torch.Tensor | None = None,
) -> dict[str, float]:
    """The student's per-token reverse KL to the teacher on its sampled tokens: the mean over every token
    (``distill/reverse_kl``), and by turn index (``distill/reverse_kl/turn_<k>``, the first ``turns``; a sample of a
    forked agent episode counts from its ``turn_offset``); over every replica's rows (``reduce`` sums over DP)."""
    kl = reverse_kl_per_token(student_log_probs, teacher_log_probs, mask).double()
    valid = mask.bool()
    turn = turn_index(mask, turn_offset)
    sums = torch.zeros(2, turns + 1, dtype=torch.float64)
    sums[0, 0], sums[1, 0] = kl[valid].sum(), valid.sum()
    for k in range(turns):
        at = valid & (turn == k)
        sums[0, k + 1], sums[1, k + 1] = kl[at].sum(), at.sum()
    if reduce is not None:
        sums = reduce(sums)
    if sums[1, 0] == 0:
        return {}
    out = {"distill/reverse_kl": float(sums[0, 0] / sums[1, 0])}
    for k in range(turns):
        if sums[1, k + 1] > 0:
            out[f"distill/reverse_kl/turn_{k}"] = float(sums[0, k + 1] / sums[1, k + 1])
    return out
