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

**Top-k** (``top_k`` = k > 0). One sampled token is one draw of the KL: it tells the student its sample was worse
than the teacher's liking, not which token the teacher wanted. With ``top_k`` the teacher returns its ``k`` most
likely next tokens at every sampled position, and the student is trained *directly* on a KL between the two
next-token distributions there, a loss term, not an advantage (:func:`top_k_kl`)::

    loss += coef * mean_t KL_k(teacher_t, student_t)

over the ``k + 1`` outcomes "one of the teacher's top k" and "anything else" (the tail bucket), so it is a true KL
(>= 0, 0 exactly when the two agree on those k tokens and on the tail mass) and a lower bound on the full-vocabulary
one. ``kl``: ``forward`` (``KL(teacher || student)``: the student puts mass where the teacher does, the usual
distillation loss) or ``reverse`` (``KL(student || teacher)`` on the same outcomes). The per-token advantage is
then not added (``add``: the task advantage alone drives the policy gradient; ``only``: no policy gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_agentic.algorithms.config import DISTILLATION_KLS
from mcore_agentic.algorithms.turn_advantages import TURN_METRIC_TURNS, turn_index

__all__ = ["distillation_advantages", "distillation_metrics", "reverse_kl_per_token", "top_k_kl"]

TAIL_FLOOR = 1e-6
"""Tail probabilities are floored here inside the logarithm: float32 sums of k probabilities that should reach 1
miss it by ~1e-7, and a log of that rounding would dominate the term (and its gradient)."""

Reduce = Callable[[torch.Tensor], torch.Tensor]


def reverse_kl_per_token(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log p_student - log p_teacher`` on the sampled tokens (``mask`` 1), 0 elsewhere: each token's sample of the
    reverse KL."""
    diff = student_log_probs.float() - teacher_log_probs.float()
    return torch.where(mask.bool(), diff, diff.new_zeros(()))  # a device zero: no host scalar copied in


def top_k_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, *, direction: str) -> torch.Tensor:
    """Per-token KL between teacher and student over the teacher's top k and the tail: ``[..., k]`` log-probs of
    the same k ids (each normalised over the whole vocabulary) -> ``[...]``.

    ``forward``: ``sum_i pT_i (log pT_i - log pS_i) + pT_tail (log pT_tail - log pS_tail)``; ``reverse``: the same
    with the roles swapped. ``pX_tail = 1 - sum_i pX_i``. Differentiable in both inputs (the teacher's are data)."""
    if direction not in DISTILLATION_KLS:
        raise ValueError(f"direction must be one of {DISTILLATION_KLS}, got {direction!r}")
    ls, lt = student_log_probs.float(), teacher_log_probs.float()
    ps, pt = ls.exp(), lt.exp()
    ps_tail = (1.0 - ps.sum(-1)).clamp(min=0.0)
    pt_tail = (1.0 - pt.sum(-1)).clamp(min=0.0)
    ls_tail, lt_tail = ps_tail.clamp(min=TAIL_FLOOR).log(), pt_tail.clamp(min=TAIL_FLOOR).log()
    if direction == "forward":
        return (pt * (lt - ls)).sum(-1) + pt_tail * (lt_tail - ls_tail)
    return (ps * (ls - lt)).sum(-1) + ps_tail * (ls_tail - lt_tail)


def distillation_advantages(
    advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor,
    *, mode: str, coef: float, top_k: int = 0,
) -> torch.Tensor:
    """The advantages with the teacher's term: ``advantages + coef * (lp_T - lp_S)`` (``add``) or the term alone
    (``only``), on sampled tokens; 0 on every other token. With ``top_k`` the teacher's signal is the loss term
    :func:`top_k_kl` instead: ``add`` keeps the task advantages, ``only`` zeroes them."""
    if mode not in ("add", "only"):
        raise ValueError(f"mode must be add or only, got {mode!r}")
    task = torch.where(mask.bool(), advantages, advantages.new_zeros(()))
    if top_k:
        return task if mode == "add" else torch.zeros_like(task)
    term = -coef * reverse_kl_per_token(student_log_probs, teacher_log_probs, mask)
    if mode == "only":
        return term.to(advantages.dtype)
    return (task + term).to(advantages.dtype)


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
