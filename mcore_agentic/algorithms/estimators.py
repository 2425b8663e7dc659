"""The advantage estimators: one registered :class:`Estimator` each, stating its function and what it needs.

``algorithm.adv_estimator`` names an entry of :data:`ESTIMATORS`. Each entry declares what the rest of a run must
provide: values from a critic (``needs_critic``), prompt groups (``groups``: one uid per row, ``rollout.n >= 2``),
turn-level data (``turn_level``: each turn's return, episodes' turn offsets, the per-turn metrics) and the per-row
fields of ``feed/fields.py`` it reads (``row_fields``). The config's checks and properties
(``AlgorithmConfig.needs_critic`` / ``needs_groups``), the dispatcher
(:func:`mcore_agentic.algorithms.advantages.compute_advantage`), the experience step and the feed's wanted fields
read these declarations; none of them names an estimator.

**Adding an estimator** is one :func:`register` call plus its function ``fn(cfg, inputs) -> (advantages, returns)``
(``cfg`` the :class:`~mcore_agentic.algorithms.config.AlgorithmConfig`, ``inputs`` an :class:`EstimatorInputs`;
both outputs ``[B, R]``). The built-ins below name their functions as ``"module:attribute"`` strings, resolved on
first use, so that this module (which the light config reads) imports no torch. Light imports only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mcore_agentic.utils.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from mcore_agentic.algorithms.config import AlgorithmConfig

__all__ = ["ESTIMATORS", "Estimator", "EstimatorInputs", "estimator", "register", "unregister"]


@dataclass(frozen=True)
class EstimatorInputs:
    """What the dispatcher hands an estimator's function; each field is None where the run has none (the
    dispatcher has already refused a missing input the estimator declares)."""

    token_level_rewards: torch.Tensor
    """``[B, R]`` the token rewards (KL-in-reward applied)."""
    response_mask: torch.Tensor
    """``[B, R]`` 1 on the sampled tokens."""
    values: torch.Tensor | None = None
    """``[B, R]`` the critic's values (``needs_critic``)."""
    index: Any = None
    """One prompt uid per row, or step-wide integer group ids in ``[0, num_groups)`` (``groups``)."""
    num_groups: int | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    """A sum over the DP replicas (rows spread over them); None: one batch."""
    turn_states: torch.Tensor | None = None
    """``[B, R]`` 1 + the id of each turn's state (``"turn_states" in row_fields``)."""
    episodes: Any = None
    """Rows that are samples of one episode: ``(episode_index, num_episodes)`` for an outcome estimator, a
    ``TurnEpisodes`` (with each row's turn offset) for a ``turn_level`` one; None: a row is an episode."""


AdvantageFn = Callable[["AlgorithmConfig", EstimatorInputs], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator and what it needs (module docstring)."""

    name: str
    function: AdvantageFn | str
    """``fn(cfg, inputs) -> (advantages, returns)``, or ``"module:attribute"`` naming it (imported on first use)."""
    needs_critic: bool = False
    """It reads the critic's values: the run trains a critic."""
    groups: bool = False
    """It compares the rows of one prompt: it needs ``index`` (one uid per row) and ``rollout.n >= 2``."""
    turn_level: bool = False
    """It works per turn: episodes' samples need their turn offsets, and the step logs the per-turn metrics."""
    row_fields: frozenset[str] = field(default_factory=frozenset)
    """The per-row fields of ``feed/fields.py`` it reads beyond those every run sends: a run with it wants them."""
    doc: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an estimator needs a name")
        if isinstance(self.function, str) and ":" not in self.function:
            raise ValueError(f"estimator {self.name}: a function named by string is 'module:attribute', "
                             f"not {self.function!r}")
        object.__setattr__(self, "row_fields", frozenset(self.row_fields))

    @property
    def fn(self) -> AdvantageFn:
        """The advantage function (imported here the first time when named by string)."""
        if not isinstance(self.function, str):
            return self.function
        module, _, attribute = self.function.partition(":")
        return getattr(importlib.import_module(module), attribute)


ESTIMATORS: dict[str, Estimator] = {}
"""Every known estimator by name (``algorithm.adv_estimator``), in registration order."""


def register(name: str, fn: AdvantageFn | str | None = None, *, needs_critic: bool = False, groups: bool = False,
             turn_level: bool = False, row_fields: Iterable[str] = (), doc: str = "") -> Any:
    """Add an estimator; returns its :class:`Estimator`. Without ``fn``, a decorator of the function (which it
    returns unchanged). A name already taken is an error."""

    def add(function: AdvantageFn | str) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is registered already")
        est = Estimator(name, function, needs_critic=needs_critic, groups=groups, turn_level=turn_level,
                        row_fields=frozenset(row_fields), doc=doc)
        ESTIMATORS[name] = est
        return est

    if fn is None:
        def decorate(function: AdvantageFn) -> AdvantageFn:
            add(function)
            return function
        return decorate
    return add(fn)


def unregister(name: str) -> None:
    """Remove an estimator (tests that register one of their own)."""
    ESTIMATORS.pop(name, None)


def estimator(name: str) -> Estimator:
    """The estimator ``algorithm.adv_estimator`` names; an unknown name is a one-line :class:`ConfigError`."""
    try:
        return ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ConfigError("algorithm.adv_estimator",
                          f"unknown estimator {name!r}; use one of {', '.join(ESTIMATORS)}") from None


_ADV = "mcore_agentic.algorithms.advantages"
register("gae", f"{_ADV}:estimate_gae", needs_critic=True,
         doc="GAE over the sampled tokens with the critic's values")
register("grpo", f"{_ADV}:estimate_grpo", groups=True,
         doc="the row's score minus its group's mean, over the group's std (algorithm.norm_adv_by_std_in_grpo)")
register("rloo", f"{_ADV}:estimate_rloo", groups=True,
         doc="the row's score minus the mean of the other rows of its group")
register("reinforce_plus_plus", f"{_ADV}:estimate_reinforce_plus_plus",
         doc="discounted returns over the sampled tokens, whitened over the batch")
register("reinforce_plus_plus_baseline", f"{_ADV}:estimate_reinforce_plus_plus_baseline", groups=True,
         doc="the row's score minus its group's mean, whitened over the batch")
register("grpo_turn", f"{_ADV}:estimate_grpo_turn", groups=True, turn_level=True,
         doc="each turn's return-to-go against the other rows' at the same turn index")
register("gigpo", f"{_ADV}:estimate_gigpo", groups=True, turn_level=True, row_fields={"turn_states"},
         doc="an episode-level group advantage plus a step-level one over turns from the same state")
