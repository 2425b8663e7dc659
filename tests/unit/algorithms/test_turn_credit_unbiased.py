"""Unbiasedness of ``grpo_turn``, measured exactly on a small MDP in which the policy decides when the episode ends.

The MDP. Turns ``t = 0 .. T-1``. At turn ``t < T-1`` the policy continues with probability ``p_t = sigmoid(theta_t)``
(one parameter per turn index) and stops otherwise; at turn ``T-1`` it must stop. Continuing at turn ``t`` earns the
intermediate reward ``c_t`` and moves to turn ``t+1``; stopping at turn ``t`` earns the final reward ``F_t``. A
trajectory is its stopping turn ``j``: rewards ``c_0 .. c_{j-1}, F_j``, probability ``q_j (1 - p_j)`` (``q_j`` for
``j = T-1``), with ``q_k = p_0 ... p_{k-1}`` the probability of reaching turn ``k``. The score of turn ``k`` is
``d log pi / d theta_k = 1 - p_k`` on "continue" and ``-p_k`` on "stop" (zero in every other coordinate).

Each trajectory is one row: turn ``t`` is one sampled token (mask 1, carrying the turn's reward) at column ``2t``
followed by one masked separator token, so the turns are the runs of the mask, as in a chat. A group of ``n`` rows
gives the score-function estimate ``g = (1/n) sum_i sum_k A_{i,k} grad log pi(a_{i,k})``.

The target. ``G_{i,k}`` is the discounted return-to-go, so ``E[g]_k`` should be ``q_k dV_k/dtheta_k``, with ``V_k``
the expected discounted return from turn ``k``: for ``gamma = 1`` the gradient of the expected return, for
``gamma < 1`` the usual discounted policy gradient (states weighted by how often they are reached, undiscounted),
which is ``gamma^-k d J_gamma / d theta_k`` with ``J_gamma = V_0``. It is computed by autograd.

The expectations are exact, not sampled: every joint outcome of a group (``T^n`` of them) is enumerated, weighted by
its probability, and all outcomes go through one call of the estimator, each outcome its own group.

What each test shows:

* ``grpo_turn`` (leave-one-out mean of the returns-to-go at the same turn index) has ``E[g]`` equal to the target to
  1e-9, for several parameters, group sizes 2-4 and ``gamma`` 1 and 0.8; and a Monte-Carlo average over sampled
  groups agrees within four standard errors.
* The MT-GRPO-style construction (normalise each turn's reward against the group's mean reward at that turn index,
  self included, and sum the normalised rewards from ``k`` to the row's own last turn) is biased exactly as its
  closed form predicts: its future terms cancel the value of continuing, so only the immediate reward difference
  ``c_k - F_k`` is left, shrunk by the self-inclusion. On this MDP that even reverses the sign of the gradient: it
  teaches to stop where continuing pays.
* Including row ``i`` in its own baseline scales coordinate ``k`` by ``(1 - E[1/n_k])``, a different factor per turn
  index: biased too, also as predicted.
* ``gigpo`` in its ``mean_norm`` form (leave-one-out at both levels; step groups by observation, which on this MDP
  lumps all turn indices together, or by history) estimates ``1 + step_advantage_w`` times the gradient exactly.
* GiGPO's own convention for a step group of one (step advantage 0 rather than a zero baseline) weighs each turn's
  term by the chance that another row reaches its state: biased, and the check says so.
* The unbiasedness check fails on every counter-example, so it can fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
import torch

from mcore_agentic.algorithms.sequence_advantages import compute_rloo_outcome_advantage, group_ids
from mcore_agentic.algorithms.turn_advantages import compute_gigpo_advantage, compute_grpo_turn_advantage, turn_spans

T = 4  # turns; the last one must stop
C = (0.3, 0.5, 0.2)  # intermediate reward of continuing at turn t (t < T-1)
F = (0.5, 0.2, 0.6, 1.5)  # final reward of stopping at turn t: stopping early pays now, continuing pays later
WIDTH = 2 * T  # one sampled token and one masked separator per turn
THETAS = ((0.0, 0.0, 0.0), (0.5, -1.0, 1.2), (-1.5, 2.0, -0.3))
TOL = 1e-9
DTYPE = torch.float64

# (token_level_rewards [B, R], response_mask [B, R], group uids, gamma) -> advantages [B, R]
Estimator = Callable[[torch.Tensor, torch.Tensor, Sequence[int], float], torch.Tensor]


def grpo_turn(rewards: torch.Tensor, mask: torch.Tensor, index: Sequence[int], gamma: float) -> torch.Tensor:
    return compute_grpo_turn_advantage(rewards, mask, index, gamma)[0]


STEP_W = 0.5


def gigpo(state: str) -> Estimator:
    """``gigpo`` (``mean_norm``) over ``1 + STEP_W``: its two parts each estimate the gradient, so the sum estimates
    ``1 + STEP_W`` times it. ``observation``: every turn of this MDP sees the same observation (one step group for
    all turns of the group, whatever their index); ``history``: a turn's history is its index."""

    def estimate(rewards: torch.Tensor, mask: torch.Tensor, index: Sequence[int], gamma: float) -> torch.Tensor:
        turn, _ = turn_spans(mask)
        states = mask.long() if state == "observation" else torch.where(turn >= 0, turn + 1, torch.zeros_like(turn))
        adv = compute_gigpo_advantage(rewards, mask, states, index, gamma, step_advantage_w=STEP_W)[0]
        return adv / (1 + STEP_W)

    return estimate


# --- the counter-examples, built in the test only --------------------------------------------------------------------


def _per_turn(rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(turn of each token [B, R], turn rewards [B, W], reached [B, W] bool) from the runs of the mask."""
    turn, counts = turn_spans(mask)
    width = int(counts.max())
    slot = torch.where(turn >= 0, turn, torch.full_like(turn, width))
    per_turn = torch.zeros(mask.shape[0], width + 1, dtype=DTYPE).scatter_add_(1, slot, rewards.to(DTYPE) * mask)
    reached = torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)
    return turn, per_turn[:, :width], reached


def _group_mean_with_self(values: torch.Tensor, reached: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """Per row and turn index: the mean of ``values`` over the group's rows that reached that turn, self included."""
    gid, num_groups = group_ids(index, values.shape[0])
    live = reached.to(DTYPE)
    sums = torch.zeros(num_groups, values.shape[1], dtype=DTYPE).index_add_(0, gid, values * live)
    seen = torch.zeros_like(sums).index_add_(0, gid, live)
    return (sums / seen.clamp(min=1))[gid]


def _spread(per_turn: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    return torch.where(turn >= 0, per_turn.gather(1, turn.clamp(min=0)), torch.zeros((), dtype=DTYPE))


def mt_grpo(rewards: torch.Tensor, mask: torch.Tensor, index: Sequence[int], gamma: float) -> torch.Tensor:
    """Per-turn-index normalisation: ``A_{i,k} = sum_{m=k}^{K_i-1} (r_{i,m} - mean_{j: K_j > m} r_{j,m})``."""
    assert gamma == 1.0
    turn, r, reached = _per_turn(rewards, mask)
    normalised = (r - _group_mean_with_self(r, reached, index)) * reached
    to_end = normalised.flip(-1).cumsum(-1).flip(-1) * reached  # reached is a prefix: the sum stops at K_i - 1
    return _spread(to_end, turn)


def include_self(rewards: torch.Tensor, mask: torch.Tensor, index: Sequence[int], gamma: float) -> torch.Tensor:
    """``grpo_turn`` with row ``i`` in its own baseline: ``A_{i,k} = G_{i,k} - mean_{j: K_j > k} G_{j,k}``."""
    assert gamma == 1.0
    turn, r, reached = _per_turn(rewards, mask)
    returns = (r * reached).flip(-1).cumsum(-1).flip(-1) * reached
    return _spread((returns - _group_mean_with_self(returns, reached, index)) * reached, turn)


def gigpo_singletons_zero(rewards: torch.Tensor, mask: torch.Tensor, index: Sequence[int], gamma: float) -> torch.Tensor:
    """GiGPO's convention for a step group of one (step advantage 0 instead of a zero baseline), with history states
    (here: the turn index), over ``1 + STEP_W`` like :func:`gigpo`."""
    turn, _, reached = _per_turn(rewards, mask)
    gid, num_groups = group_ids(index, mask.shape[0])
    live = reached.to(DTYPE)
    seen = torch.zeros(num_groups, live.shape[1], dtype=DTYPE).index_add_(0, gid, live)
    shared = _spread(((seen[gid] - live) > 0).to(DTYPE), turn)  # another row of the group acted at this turn index
    step = compute_grpo_turn_advantage(rewards, mask, index, gamma)[0].to(DTYPE) * shared
    episode = compute_rloo_outcome_advantage(rewards, mask, index)[0].to(DTYPE)
    return (episode + STEP_W * step) / (1 + STEP_W)


# --- the MDP ---------------------------------------------------------------------------------------------------------


def _probs(theta: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_k continue at turn k [T-1], q_k reach turn k [T])."""
    p = torch.sigmoid(torch.tensor(theta, dtype=DTYPE))
    q = torch.cat([torch.ones(1, dtype=DTYPE), torch.cumprod(p, 0)])
    return p, q


def _values(theta: torch.Tensor, gamma: float) -> list[torch.Tensor]:
    """``V_k``, the expected discounted return from turn ``k``, as differentiable functions of ``theta``."""
    p = torch.sigmoid(theta)
    values = [torch.tensor(F[-1], dtype=DTYPE)]
    for k in reversed(range(T - 1)):
        values.insert(0, p[k] * (C[k] + gamma * values[0]) + (1 - p[k]) * F[k])
    return values


def target_gradient(theta: Sequence[float], gamma: float) -> torch.Tensor:
    """``q_k dV_k / d theta_k`` by autograd: what ``E[sum_k grad log pi_k G_k]`` is."""
    th = torch.tensor(theta, dtype=DTYPE, requires_grad=True)
    values = _values(th, gamma)
    _, q = _probs(theta)
    return torch.stack([q[k] * torch.autograd.grad(values[k], th, retain_graph=True)[0][k] for k in range(T - 1)])


def _trajectories(theta: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per stopping turn ``j``: (rewards [T, R], mask [T, R], scores [T, T-1], probability [T])."""
    p, q = _probs(theta)
    rewards = torch.zeros(T, WIDTH, dtype=DTYPE)
    mask = torch.zeros(T, WIDTH, dtype=torch.long)
    scores = torch.zeros(T, T - 1, dtype=DTYPE)
    for j in range(T):
        for t in range(j + 1):
            mask[j, 2 * t] = 1
            rewards[j, 2 * t] = C[t] if t < j else F[j]
        for k in range(min(j + 1, T - 1)):
            scores[j, k] = 1 - p[k] if k < j else -p[k]
    prob = torch.cat([q[:-1] * (1 - p), q[-1:]])
    return rewards, mask, scores, prob


def _group_gradients(estimator: Estimator, stops: torch.Tensor, theta: Sequence[float], gamma: float) -> torch.Tensor:
    """Each group's estimate ``g`` [G, T-1] for stopping turns ``stops`` [G, n], all groups in one estimator call."""
    rewards, mask, scores, _ = _trajectories(theta)
    num_groups, n = stops.shape
    rows = stops.reshape(-1)
    index = torch.arange(num_groups).repeat_interleave(n).tolist()
    adv = estimator(rewards[rows], mask[rows], index, gamma)
    per_turn = adv[:, 0 : 2 * (T - 1) : 2].to(DTYPE)  # each turn's advantage, read on its sampled token
    return (per_turn * scores[rows]).reshape(num_groups, n, T - 1).sum(1) / n


def exact_expected_gradient(estimator: Estimator, theta: Sequence[float], gamma: float, n: int) -> torch.Tensor:
    """``E[g]`` over groups of ``n`` rows, exactly: every joint outcome of the group, weighted by its probability."""
    stops = torch.tensor(list(itertools.product(range(T), repeat=n)), dtype=torch.long)
    prob = _trajectories(theta)[3][stops].prod(1)
    assert abs(float(prob.sum()) - 1) < 1e-12
    return prob @ _group_gradients(estimator, stops, theta, gamma)


def check_unbiased(estimator: Estimator, theta: Sequence[float], gamma: float, n: int) -> None:
    bias = exact_expected_gradient(estimator, theta, gamma, n) - target_gradient(theta, gamma)
    assert float(bias.abs().max()) < TOL, f"E[g] - grad J = {bias.tolist()} (theta={theta}, gamma={gamma}, n={n})"


def _alone_at(theta: Sequence[float], n: int) -> torch.Tensor:
    """``E[1 / n_k]`` for a row at turn ``k``: ``n_k = 1 + Binomial(n - 1, q_k)``, i.e. ``(1 - (1-q)^n) / (n q)``."""
    _, q = _probs(theta)
    return ((1 - (1 - q) ** n) / (n * q))[: T - 1]


def _continue_minus_stop(theta: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``q_k p_k (1 - p_k)``, ``V_{k+1}``) for ``gamma = 1``: the target is ``weight * (c_k + V_{k+1} - F_k)``."""
    p, q = _probs(theta)
    values = torch.stack(_values(torch.tensor(theta, dtype=DTYPE), 1.0))
    return q[: T - 1] * p * (1 - p), values[1:]


# --- tests -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1.0, 0.8])
@pytest.mark.parametrize("theta", THETAS)
def test_target_is_the_policy_gradient(theta: tuple[float, ...], gamma: float) -> None:
    """The autograd target is the closed-form policy gradient, and ``gamma^-k`` times the gradient of ``J_gamma``."""
    target = target_gradient(theta, gamma)
    p, q = _probs(theta)
    values = torch.stack(_values(torch.tensor(theta, dtype=DTYPE), gamma)).detach()
    immediate = torch.tensor(C, dtype=DTYPE) - torch.tensor(F[:-1], dtype=DTYPE)
    closed = q[:-1] * p * (1 - p) * (immediate + gamma * values[1:])
    torch.testing.assert_close(target, closed, rtol=0, atol=1e-12)
    th = torch.tensor(theta, dtype=DTYPE, requires_grad=True)
    grad_j = torch.autograd.grad(_values(th, gamma)[0], th)[0]
    discount = torch.tensor([gamma**k for k in range(T - 1)], dtype=DTYPE)
    torch.testing.assert_close(target, grad_j / discount, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("gamma", [1.0, 0.8])
@pytest.mark.parametrize("theta", THETAS)
def test_grpo_turn_is_unbiased_exactly(theta: tuple[float, ...], gamma: float, n: int) -> None:
    check_unbiased(grpo_turn, theta, gamma, n)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("state", ["observation", "history"])
@pytest.mark.parametrize("theta", THETAS)
def test_gigpo_mean_norm_is_unbiased_exactly(theta: tuple[float, ...], state: str, n: int) -> None:
    """Its episode part uses the undiscounted score, so the check is at ``gamma = 1``. With ``observation`` states the
    step groups mix turn indices: the baseline of turn ``k`` then averages other rows' turns of any index, which is
    still a function of the other rows only."""
    check_unbiased(gigpo(state), theta, 1.0, n)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("theta", THETAS)
def test_per_turn_index_normalisation_is_biased_as_predicted(theta: tuple[float, ...], n: int) -> None:
    """MT-GRPO-style: ``A = G_k - sum_{m=k}^{K_i-1} mu_m`` with ``mu_m`` the group's mean reward at turn ``m``, self
    included. Its baseline's expected score-weighted value: given the row reached ``m``, ``E[mu_m] = rho_m``, the
    expected reward at turn ``m`` (the row's own reward and the others' share that mean), so the terms ``m > k`` add
    up to ``V_{k+1}`` on "continue" and are absent on "stop"; at ``m = k`` the row's own reward enters ``mu_k`` with
    weight ``E[1/n_k] = e_k``. Hence

        bias_k = -q_k p_k (1 - p_k) [ (c_k - F_k) e_k + V_{k+1} ],
        E[g]_k = q_k p_k (1 - p_k) (1 - e_k) (c_k - F_k):

    the value of continuing cancels out, only the immediate reward difference is left."""
    expected = exact_expected_gradient(mt_grpo, theta, 1.0, n)
    target = target_gradient(theta, 1.0)
    weight, future = _continue_minus_stop(theta)
    e = _alone_at(theta, n)
    immediate = torch.tensor(C, dtype=DTYPE) - torch.tensor(F[:-1], dtype=DTYPE)
    torch.testing.assert_close(expected - target, -weight * (immediate * e + future), rtol=0, atol=TOL)
    torch.testing.assert_close(expected, weight * (1 - e) * immediate, rtol=0, atol=TOL)
    assert float((expected - target).abs().max()) > 0.01
    # c_0 < F_0 and c_2 < F_2 while continuing pays: the biased estimator pushes the wrong way on turns 0 and 2.
    assert (expected[[0, 2]] < 0).all() and (target[[0, 2]] > 0).all()


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("theta", THETAS)
def test_including_self_in_the_baseline_reweights_turns(theta: tuple[float, ...], n: int) -> None:
    """``A = G_k - mean_{j: K_j > k} G_{j,k}`` (self included) is ``(1 - 1/n_k) G_k`` minus a term independent of
    row ``i``'s action: ``E[g]_k = (1 - e_k) * target_k``, with ``e_k = E[1/n_k]`` growing with ``k`` as fewer rows
    reach later turns. Not a common scale: the direction changes too."""
    expected = exact_expected_gradient(include_self, theta, 1.0, n)
    target = target_gradient(theta, 1.0)
    e = _alone_at(theta, n)
    torch.testing.assert_close(expected, (1 - e) * target, rtol=0, atol=TOL)
    assert float((expected - target).abs().max()) > 0.01
    cosine = torch.nn.functional.cosine_similarity(expected, target, dim=0)
    assert float(cosine) < 0.995


@pytest.mark.parametrize("estimator", [mt_grpo, include_self, gigpo_singletons_zero])
def test_the_unbiasedness_check_can_fail(estimator: Estimator) -> None:
    for theta in THETAS:
        with pytest.raises(AssertionError, match="E\\[g\\] - grad J"):
            check_unbiased(estimator, theta, 1.0, 3)
    bias = exact_expected_gradient(estimator, THETAS[1], 1.0, 3) - target_gradient(THETAS[1], 1.0)
    assert float(bias.abs().max()) > 1e6 * TOL


def _sample_stops(theta: Sequence[float], groups: int, n: int, seed: int) -> torch.Tensor:
    p, _ = _probs(theta)
    gen = torch.Generator().manual_seed(seed)
    cont = torch.rand(groups * n, T - 1, generator=gen, dtype=DTYPE) < p
    return cont.long().cumprod(1).sum(1).reshape(groups, n)  # stopping turn = number of leading "continue"s


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_grpo_turn_monte_carlo_matches_within_standard_error(gamma: float) -> None:
    theta, groups, n = THETAS[1], 4000, 3
    g = _group_gradients(grpo_turn, _sample_stops(theta, groups, n, seed=1234), theta, gamma)
    mean, se = g.mean(0), g.std(0) / groups**0.5
    target = target_gradient(theta, gamma)
    assert ((mean - target).abs() < 4 * se).all(), f"mean {mean.tolist()} target {target.tolist()} se {se.tolist()}"
    if gamma == 1.0:  # the same samples put the per-turn-index normalisation many standard errors off
        b = _group_gradients(mt_grpo, _sample_stops(theta, groups, n, seed=1234), theta, gamma)
        assert ((b.mean(0) - target).abs() > 4 * b.std(0) / groups**0.5).any()
