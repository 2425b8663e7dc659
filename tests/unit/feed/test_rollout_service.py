"""A rollout rank's engine dies during a step (separate placement): the service rebuilds it, loads the weights it held
and generates the step again from where it began. The step's rows equal those of a run whose engine never failed
(same prompts, tokens, log-probs and weight versions: nothing lost, nothing twice), and the restart is counted.

The real pieces of a rollout rank: the default task's feed built as an engine's rank builds it (the transformers
engine behind the fault guard, the meter task's tools and reward), weights loaded through the service as they
arrive over the link. The fault: the engine's third ``generate`` raises as a dead engine does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_agentic.feed.engine_guard import GuardedEngine, is_engine_fault


class DyingEngine:
    """An engine whose ``generate`` raises from its ``die_at``-th call on (its process gone)."""

    def __init__(self, engine: Any, die_at: int):
        self.engine, self.die_at, self.calls = engine, die_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls >= self.die_at:
            raise RuntimeError("engine core died")
        return await self.engine.generate(*args, **kwargs)


def _service(model_dir: Path, die_at: int | None) -> Any:
    from mcore_agentic.config import compose, load_config
    from mcore_agentic.feed import RolloutService
    from mcore_agentic.models.hf_io import SafetensorsState
    from mcore_agentic.parallel.job import JobSplit
    from mcore_agentic.trainer.rollout_rank import build_rollout_feed

    cfg = load_config(compose("default_tiny", [
        f"model.model_path={model_dir}", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=32", "rollout.placement=separate",
        "rollout.rollout_ranks=1", "trainer.rollout_data_dir=null"]), log_aliases=False)
    feed = build_rollout_feed(cfg, JobSplit(3, rollout_ranks=1, rollout_tp=1, rank=2), None)  # as an engine's rank
    assert isinstance(feed.engine, GuardedEngine)
    if die_at is not None:
        feed.engine.inner = DyingEngine(feed.engine.inner, die_at)
    service = RolloutService(feed, None, max_staleness=1, rebuild=feed.engine_factory)
    # Version 3 of the weights arrives (the checkpoint's, perturbed): a rebuilt engine must load it, not the checkpoint.
    g = torch.Generator().manual_seed(0)
    named = SafetensorsState(str(model_dir))
    service.staged = [[(n, named[n] + 0.01 * torch.randn(named[n].shape, generator=g)) for n in sorted(named)]]
    service._handle((2, 3, 0))  # WEIGHTS, version 3
    return service


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from mcore_agentic.models.tiny import make_tiny_hf_model_from_preset

    return make_tiny_hf_model_from_preset(tmp_path_factory.mktemp("tiny") / "tiny_qwen2", "tiny", seed=0)


def _rows(rollout: Any) -> dict[str, torch.Tensor]:
    return {k: rollout.rows[k] for k in ("input_ids", "response_mask", "rollout_log_probs", "seq_scores")}


def test_a_dead_engine_is_rebuilt_and_its_step_generated_again(model_dir: Path) -> None:
    healthy = _service(model_dir, die_at=None)
    expected = healthy.produce(0)
    healthy.feed.close()

    service = _service(model_dir, die_at=3)
    got = service.produce(0)
    assert service.restarts == 1 and not isinstance(service.engine.inner, DyingEngine)
    assert service.engine.fault is None and int(service.engine.weight_version) == 3
    states = [m["state"] for b in got.generated for m in b.meta["request_metrics"]]
    assert states and all(s != "failed" for s in states)
    for name, tensor in _rows(expected).items():
        assert torch.equal(_rows(got)[name], tensor), name
    assert got.rows["oldest_version"] == expected.rows["oldest_version"] == [3] * len(got.rows)
    service.feed.close()


def test_what_counts_as_the_engines_fault() -> None:
    assert is_engine_fault(RuntimeError("engine core died")) and is_engine_fault(OSError("broken pipe"))
    assert not is_engine_fault(ValueError("prompt of 9000 tokens exceeds max_model_len"))
