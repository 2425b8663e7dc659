"""Reward dispatch by data_source, custom functions from config, score_of."""

import pytest

from mcore_agentic.rewards import (
    DATA_SOURCES,
    RewardConfig,
    RewardFn,
    build_reward_fn,
    compute_score,
    load_reward_function,
    score_of,
)
from mcore_agentic.utils.errors import ConfigError


def length_reward(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return {"score": scale * len(solution_str), "source_is_custom": data_source == "custom"}


class MatchReward:
    def __init__(self, bonus: float = 0.0):
        self.bonus = bonus

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth) + self.bonus


def two_args(solution_str, ground_truth):
    return 0.0


def test_dispatch_by_exact_data_source():
    assert compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert compute_score("gsm8k", "she has 72", "72", method="flexible") == 1.0
    assert compute_score("synthetic/tool_arith", "#### 5", "5") == 1.0
    assert compute_score("lighteval/MATH", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    # kwargs reach only the rules that take them (tool_arith has no 'method')
    assert compute_score("synthetic/tool_arith", "#### 4", "5", method="flexible", format_score=0.5) == 0.5


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(ConfigError, match="data_source.*'GSM8K'.*openai/gsm8k.*synthetic/tool_arith"):
        compute_score("GSM8K", "#### 1", "1")  # exact names only, no case folding
    assert set(DATA_SOURCES) >= {"openai/gsm8k", "gsm8k", "math", "synthetic/tool_arith"}


def test_build_default_with_kwargs_and_validation():
    fn = build_reward_fn(RewardConfig(reward_kwargs={"format_score": 0.1}))
    assert isinstance(fn, RewardFn)
    assert fn("gsm8k", "#### 3", "4") == 0.1
    assert fn("synthetic/tool_arith", "#### 3", "4", None) == 0.1
    with pytest.raises(ConfigError, match="reward.reward_kwargs.*'formt_score'.*format_score"):
        build_reward_fn(RewardConfig(reward_kwargs={"formt_score": 0.1}))


def test_custom_function_by_module_path():
    fn = build_reward_fn(
        RewardConfig(
            custom_reward_function="tests.unit.rewards.test_registry:length_reward", reward_kwargs={"scale": 2}
        )
    )
    assert fn("custom", "abc", "x", None) == {"score": 6.0, "source_is_custom": True}
    dotted = load_reward_function("tests.unit.rewards.test_registry.length_reward")
    assert score_of(dotted("d", "ab", "x")) == 2.0


def test_custom_class_is_instantiated_once_with_kwargs():
    fn = load_reward_function("tests.unit.rewards.test_registry:MatchReward", {"bonus": 0.5})
    assert fn("d", " 42 ", "42", None) == 1.5
    with pytest.raises(ConfigError, match="reward.reward_kwargs"):
        load_reward_function("tests.unit.rewards.test_registry:MatchReward", {"nope": 1})


def test_custom_function_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n")
    fn = load_reward_function(f"{path}:compute_score")
    assert fn("d", "s", "g", {}) == 0.25


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_module_here", "names no module"),
        ("not_a_real_module_xyz:f", "cannot import module"),
        ("tests.unit.rewards.test_registry:missing", "has no attribute 'missing'"),
        ("tests.unit.rewards.test_registry:two_args", "must accept \\(data_source, solution_str"),
        ("tests.unit.rewards.test_registry:DATA_SOURCES", "not a function or class"),
        ("/does/not/exist.py:f", "not found"),
    ],
)
def test_bad_custom_function_names_the_field(spec, message):
    with pytest.raises(ConfigError, match="reward.custom_reward_function.*" + message):
        load_reward_function(spec)


def test_config_validation_and_score_of():
    with pytest.raises(ConfigError, match="reward.custom_reward_function"):
        RewardConfig(custom_reward_function="  ")
    with pytest.raises(ConfigError, match="reward.reward_kwargs"):
        RewardConfig(reward_kwargs=[1, 2])
    assert score_of(1) == 1.0 and score_of(True) == 1.0 and score_of({"score": 0.5, "acc": 1}) == 0.5
    with pytest.raises(ValueError, match="without a 'score' key"):
        score_of({"acc": 1.0})
    with pytest.raises(TypeError, match="float or a dict"):
        score_of("1.0")
