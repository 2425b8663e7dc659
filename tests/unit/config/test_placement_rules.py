"""``rollout.placement``'s rules: the job's ranks split into trainer and rollout ranks, each side checked on its own
ranks, and what separate placement refuses, one line each naming the key."""

from __future__ import annotations

import pytest

from mcore_agentic.config import compose, load_config
from mcore_agentic.config.rules import trainer_world, validate
from mcore_agentic.parallel.job import JobSplit
from mcore_agentic.utils.errors import ConfigError


def _cfg(*overrides: str):
    return load_config(compose("default_tiny", list(overrides)), log_aliases=False)


def test_the_trainers_ranks_are_the_jobs_less_the_rollouts() -> None:
    cfg = _cfg("rollout.placement=separate", "rollout.rollout_ranks=1")
    assert trainer_world(cfg, 3) == 2 and trainer_world(_cfg(), 3) == 3
    validate(cfg, 3)  # 2 trainer ranks: DP=2 splits the default job's mini-batches
    with pytest.raises(ConfigError, match="over the 3 rollout engines"):
        validate(_cfg(), 3)  # colocated, every rank generates: 8 prompts over 3 engines do not split
    with pytest.raises(ConfigError, match="rollout.rollout_ranks: =1 leaves no trainer rank in a job of 1"):
        validate(cfg, 1)
    # 4 prompts over 3 engines: the rollout ranks' rule, on the rollout ranks
    with pytest.raises(ConfigError, match="data.train_batch_size: =8 prompts do not split over the 3 rollout engines"):
        validate(_cfg("rollout.placement=separate", "rollout.rollout_ranks=3"), 5)


@pytest.mark.parametrize(("overrides", "field"), [
    (["rollout.rollout_ranks=1"], "rollout.rollout_ranks"),  # colocated takes no rollout ranks
    (["rollout.placement=separate"], "rollout.rollout_ranks"),  # separate needs some
    (["rollout.placement=separate", "rollout.rollout_ranks=1", "rollout.max_staleness=0"], "rollout.max_staleness"),
    (["rollout.placement=separate", "rollout.rollout_ranks=1", "rollout.partial_rollout.enable=true",
      "rollout.partial_rollout.max_staleness=2"], "rollout.partial_rollout.max_staleness"),
    (["rollout.placement=elsewhere"], "rollout.placement"),
])
def test_a_bad_placement_is_one_line_naming_its_key(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(_cfg(*overrides), 3)
    assert err.value.field == field


def test_an_offload_around_the_rollout_is_refused_under_separate_placement() -> None:
    with pytest.raises(ConfigError, match="actor.param_offload"):
        validate(_cfg("rollout.placement=separate", "rollout.rollout_ranks=1", "actor.param_offload=true"), 3)


def test_the_split_of_a_job() -> None:
    split = JobSplit(world_size=6, rollout_ranks=4, rollout_tp=2, rank=5)
    assert (split.trainer_ranks, split.engines, split.is_rollout, split.engine_index) == (2, 2, True, 1)
    assert split.link_members == [0, 2, 4] and not split.leads_engine and JobSplit(6, 4, 2, 4).leads_engine
    assert (split.side_rank, split.side_size) == (0, 1) and (JobSplit(6, 4, 2, 1).side_size) == 2
    with pytest.raises(ValueError, match="do not split into engines of 2"):
        JobSplit(6, 3, 2, 0)
