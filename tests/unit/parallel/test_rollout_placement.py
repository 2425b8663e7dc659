"""Rollout groups: consecutive ranks, one engine on each group's first rank, disjoint prompt shares."""

from __future__ import annotations

import pytest

from mcore_agentic.config.rules import check_rollout_groups
from mcore_agentic.parallel.rollout_placement import RolloutPlacement
from mcore_agentic.utils.errors import ConfigError


def test_groups_leaders_and_shares_by_hand():
    rows = list(range(8))
    places = [RolloutPlacement(world_size=4, rank=r, tensor_parallel_size=2) for r in range(4)]
    assert [p.group_index for p in places] == [0, 0, 1, 1]
    assert [p.is_leader for p in places] == [True, False, True, False]
    assert [p.leader_rank for p in places] == [0, 0, 2, 2]
    assert places[0].num_groups == 2
    assert places[0].split_rows(rows) == [0, 1, 2, 3] == places[1].split_rows(rows)
    assert places[2].split_rows(rows) == [4, 5, 6, 7]
    assert places[2].strided_rows(list(range(5))) == [1, 3]


def test_one_engine_per_rank_covers_every_prompt_once():
    rows = list(range(6))
    places = [RolloutPlacement(world_size=3, rank=r, tensor_parallel_size=1) for r in range(3)]
    assert all(p.is_leader for p in places)
    assert sorted(x for p in places for x in p.split_rows(rows)) == rows
    assert sorted(x for p in places for x in p.strided_rows(list(range(7)))) == list(range(7))


def test_bad_sizes_name_the_field():
    with pytest.raises(ConfigError) as info:
        check_rollout_groups(3, 4, 4)
    assert info.value.field == "rollout.tensor_model_parallel_size" and "world size 4" in str(info.value)
    with pytest.raises(ValueError, match="do not tile a world of 4"):
        RolloutPlacement(world_size=4, rank=0, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="do not split over 2 rollout engines"):
        RolloutPlacement(world_size=2, rank=0, tensor_parallel_size=1).split_rows([1, 2, 3])
    check_rollout_groups(2, 16, 8)
    with pytest.raises(ConfigError, match="span nodes"):
        check_rollout_groups(4, 12, 6)
