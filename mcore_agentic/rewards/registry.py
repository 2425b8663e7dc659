"""Reward dispatch: built-in rules by exact ``data_source`` name, or a custom function from config.

Every reward function has the shape of :class:`RewardFn`; results are a float or a dict with a
``score`` key (extra keys are metrics), reduced by :func:`score_of`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mcore_agentic.rewards import gsm8k, math_reward, tool_arith
from mcore_agentic.rewards.config import RewardConfig
from mcore_agentic.utils.errors import ConfigError

_FIELD = "reward.custom_reward_function"


@runtime_checkable
class RewardFn(Protocol):
    """Scores one finished response."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
    ) -> float | dict: ...


# Exact names only (no substring matching): a dataset's data_source column picks its rule.
DATA_SOURCES: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "math": math_reward.compute_score,
    "lighteval/MATH": math_reward.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_reward.compute_score,
    "HuggingFaceH4/MATH-500": math_reward.compute_score,
    "synthetic/tool_arith": tool_arith.compute_score,
    "synthetic/meter_reading": tool_arith.compute_score,
    "synthetic/meter_pair": tool_arith.compute_score,
}


def _accepted(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    **rule_kwargs: Any,
) -> float | dict:
    """Score ``solution_str`` with the built-in rule for ``data_source``.

    ``rule_kwargs`` (e.g. ``format_score=0.1``, ``method="flexible"``) reach the rules whose
    signature names them. Raises :class:`ConfigError` for an unknown data source.
    """
    rule = DATA_SOURCES.get(data_source)
    if rule is None:
        raise ConfigError(
            "data_source",
            f"no built-in reward rule for {data_source!r}; known data sources: {', '.join(sorted(DATA_SOURCES))}. "
            f"Fix the dataset's data_source column or set {_FIELD} to your own 'module:function'",
        )
    return rule(solution_str, ground_truth, **_accepted(rule, rule_kwargs))


def score_of(result: float | int | bool | Mapping[str, Any]) -> float:
    """The scalar reward of a reward function's result (a number, or a dict's ``score``)."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"a reward function returned a dict without a 'score' key: keys {sorted(result)}")
        result = result["score"]
    if isinstance(result, bool | int | float):
        return float(result)
    if hasattr(result, "item"):  # 0-d tensor / numpy scalar
        return float(result.item())
    raise TypeError(f"a reward function must return a float or a dict with 'score', got {type(result).__name__}")


def _import_object(spec: str) -> Any:
    """Resolve ``pkg.mod:name``, ``pkg.mod.name`` or ``path/to/file.py:name``."""
    if ":" in spec:
        module_part, name = spec.rsplit(":", 1)
    elif "." in spec:
        module_part, name = spec.rsplit(".", 1)
    else:
        raise ConfigError(_FIELD, f"{spec!r} names no module; use 'pkg.module:function' or 'path/file.py:function'")
    if module_part.endswith(".py"):
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise ConfigError(_FIELD, f"file {str(path)!r} not found (from {spec!r})")
        module_name = f"_mcore_agentic_custom_reward_{abs(hash(str(path.resolve())))}"
        if module_name in sys.modules:  # loaded once per process (the launcher's pre-flight, then the run)
            module = sys.modules[module_name]
            if hasattr(module, name):
                return getattr(module, name)
        directory = str(path.resolve().parent)  # the file's own imports of its neighbours work as in a script
        if directory not in sys.path:
            sys.path.insert(0, directory)
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # dataclasses/pickle need the module registered
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:  # a file that does not run: one line naming it, and no half-loaded module left
            del sys.modules[module_name]
            raise ConfigError(_FIELD, f"{path} does not load: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise ConfigError(_FIELD, f"cannot import module {module_part!r} (from {spec!r}): {exc}") from None
    if not hasattr(module, name):
        raise ConfigError(_FIELD, f"module {module_part!r} has no attribute {name!r} (from {spec!r})")
    return getattr(module, name)


def load_reward_function(spec: str, kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """The custom reward function named by ``spec``, with ``kwargs`` bound (a class: instantiated
    with them). Checked once here: it must accept ``(data_source, solution_str, ground_truth, extra_info)``."""
    kwargs = dict(kwargs or {})
    obj = _import_object(spec)
    if inspect.isclass(obj):
        try:
            fn = obj(**kwargs)
        except TypeError as exc:
            raise ConfigError("reward.reward_kwargs", f"cannot construct {spec!r} with {kwargs}: {exc}") from None
    elif callable(obj):
        fn = obj
        if kwargs:
            try:
                inspect.signature(obj).bind_partial(**kwargs)
            except TypeError as exc:
                raise ConfigError("reward.reward_kwargs", f"{spec!r} does not take {sorted(kwargs)}: {exc}") from None
            fn = functools.partial(obj, **kwargs)
    else:
        raise ConfigError(_FIELD, f"{spec!r} is a {type(obj).__name__}, not a function or class")
    if not callable(fn):
        raise ConfigError(_FIELD, f"instances of {spec!r} are not callable; define __call__")
    try:
        inspect.signature(fn).bind("data_source", "solution", "ground_truth", None)
    except TypeError:
        raise ConfigError(
            _FIELD,
            f"{spec!r} must accept (data_source, solution_str, ground_truth, extra_info), "
            f"its signature is {inspect.signature(fn)}",
        ) from None
    return fn


def build_reward_fn(config: RewardConfig) -> RewardFn:
    """The run's reward function: the custom one from config, else the built-in dispatch."""
    if config.custom_reward_function is not None:
        return load_reward_function(config.custom_reward_function, config.reward_kwargs)
    kwargs = dict(config.reward_kwargs)
    known = {name for rule in set(DATA_SOURCES.values()) for name in inspect.signature(rule).parameters}
    known -= {"solution_str", "ground_truth"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(
            "reward.reward_kwargs",
            f"{unknown} are not options of any built-in reward rule; use some of {sorted(known)}",
        )
    return functools.partial(compute_score, **kwargs)
