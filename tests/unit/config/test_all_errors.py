"""Every config problem in one run: ConfigErrors from the walk and from check_overrides."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Literal

import pytest

from mcore_agentic.config.load import check_overrides
from mcore_agentic.utils.errors import ConfigError, ConfigErrors, raise_errors, require
from mcore_agentic.utils.walk import build


@dataclass(frozen=True)
class _Optim:
    lr: float = 1e-6

    def __post_init__(self) -> None:
        require(self.lr > 0, "lr", "must be > 0")


@dataclass(frozen=True)
class _Actor:
    optim: _Optim = field(default_factory=_Optim)
    epochs: int = 1
    mode: Literal["a", "b"] = "a"

    def __post_init__(self) -> None:
        require(self.epochs != 7, "epochs", "7 is unlucky")


@dataclass(frozen=True)
class _Rollout:
    n: int = 1

    def __post_init__(self) -> None:
        require(self.n >= 1, "rollout.n", "must be >= 1")


@dataclass(frozen=True)
class _Root:
    name: str
    actor: _Actor = field(default_factory=_Actor)
    rollout: _Rollout = field(default_factory=_Rollout)


def _problems(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(_Root, data)
    return info.value


def test_every_problem_of_a_tree_is_reported_one_line_each():
    e = _problems({"actor": {"optim": {"lr": -1.0}, "epochs": "x", "mode": "c", "epoks": 2}, "rollout": {"n": 0},
                   "extra": 1})
    assert isinstance(e, ConfigErrors)
    assert [p.field for p in e.errors] == [
        "extra",  # unknown key
        "name",  # required
        "actor.epoks",  # unknown key, with its hint
        "actor.optim.lr",  # the sub-group's own __post_init__
        "actor.epochs",  # wrong type
        "actor.mode",  # Literal choice
        "rollout.n",  # __post_init__ of another group
    ]
    assert e.field == "extra"
    lines = str(e).splitlines()
    assert len(lines) == 7 and lines[2] == "actor.epoks: unknown key; did you mean actor.epochs?"
    assert all(line.startswith(f"{p.field}: ") for line, p in zip(lines, e.errors))


def test_a_group_whose_fields_failed_skips_its_post_init_and_a_clean_group_runs_it():
    e = _problems({"name": "x", "actor": {"epochs": "x"}})
    assert [p.field for p in e.errors] == ["actor.epochs"]  # not also "7 is unlucky" or a TypeError
    e = _problems({"name": "x", "actor": {"epochs": 7, "epoks": 1}})  # an unknown key does not stop its check
    assert [p.field for p in e.errors] == ["actor.epoks", "actor.epochs"]


def test_a_single_problem_is_exactly_what_it_was():
    e = _problems({"name": "x", "rollout": {"n": 0}})
    assert type(e) is ConfigError and str(e) == "rollout.n: must be >= 1" and e.errors == [e]
    several = ConfigErrors([e, ConfigError("a", "b")])
    assert several.field == "rollout.n" and str(several) == "rollout.n: must be >= 1\na: b"
    again = pickle.loads(pickle.dumps(several))
    assert str(again) == str(several) and [p.field for p in again.errors] == ["rollout.n", "a"]
    with pytest.raises(ConfigError) as info:
        raise_errors([e])
    assert info.value is e
    raise_errors([])


def test_check_overrides_names_every_bad_key_at_once():
    with pytest.raises(ConfigErrors) as info:
        check_overrides(["actor.tensor_model_paralel_size=2", "rollout.n=2", "trainer.total_trainig_steps=5",
                         "data.train_batch_sise=4", "+trainer.free_form=1"])
    assert [p.field for p in info.value.errors] == [
        "actor.tensor_model_paralel_size", "trainer.total_trainig_steps", "data.train_batch_sise"]
    assert "did you mean actor.tensor_model_parallel_size?" in str(info.value).splitlines()[0]
