"""Tracker backends: JSONL lines, TensorBoard scalars read back, console table, rank 0 only, wandb error."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
import torch

from mcore_agentic.config import ConfigError
from mcore_agentic.trainer.config import TrainerConfig
from mcore_agentic.trainer.logger import Tracker
from mcore_agentic.trainer.progress import StepProgress


def _steps():
    for step in (1, 2, 3):
        yield step, {
            "critic/score/mean": 0.25 * step,
            "response_length/mean": np.float32(10 + step),
            "actor/pg_loss": torch.tensor(-0.5 * step),
            "note": "not a number",  # ignored, never crashes a backend
        }


def test_jsonl_tensorboard_console(tmp_path):
    console = io.StringIO()
    with Tracker(
        ["console", "jsonl", "tensorboard"], tmp_path, config={"seed": 1}, console_every=2, rank=0, console_file=console
    ) as tracker:
        for step, metrics in _steps():
            tracker.log(metrics, step)
            # Flushed per step: readable while the run is still going.
            assert len(tracker.metrics_path.read_text().splitlines()) == step

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert lines[2]["critic/score/mean"] == 0.75 and lines[2]["actor/pg_loss"] == -1.5
    assert "note" not in lines[0]
    assert json.loads((tmp_path / "config.json").read_text()) == {"seed": 1}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scores = [(e.step, e.value) for e in events.Scalars("critic/score/mean")]
    assert scores == [(1, 0.25), (2, 0.5), (3, 0.75)]

    text = console.getvalue()
    assert "step 2" in text and "step 1" not in text and "step 3" not in text  # every 2nd step
    assert "critic/score/mean" in text and "0.5" in text


def test_non_zero_rank_writes_nothing(tmp_path):
    tracker = Tracker(["console", "jsonl", "tensorboard"], tmp_path / "logs", rank=1)
    tracker.log({"a": 1.0}, 1)
    tracker.close()
    assert not (tmp_path / "logs").exists()


def test_nan_is_kept_visible(tmp_path):
    with Tracker(["jsonl"], tmp_path, rank=0) as tracker:
        tracker.log({"actor/grad_norm": float("nan")}, 1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["actor/grad_norm"] == "nan"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="pip install wandb") as info:
        Tracker(["wandb"], tmp_path, rank=0)
    assert info.value.field == "trainer.logger"


def test_from_trainer_config(tmp_path):
    cfg = TrainerConfig(logger=["jsonl"], log_dir=str(tmp_path / "run"), experiment_name="e1")
    with Tracker.from_config(cfg, rank=0) as tracker:
        tracker.log({"x": 2}, 5)
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text()) == {"step": 5, "x": 2.0}
    assert TrainerConfig(project_name="p", experiment_name="e").resolved_log_dir == "outputs/p/e"


def test_progress_bar_counts_steps_and_shows_reward():
    out = io.StringIO()
    bar = StepProgress(4, initial_step=1, file=out)
    bar.update({"critic/score/mean": 0.5})
    bar.update()
    assert bar.bar.n == 3
    bar.close()
    assert "reward=0.5" in out.getvalue() and "3/4" in out.getvalue()
    StepProgress(4, enabled=False).update({"critic/score/mean": 1.0})  # rank != 0: nothing happens


def test_progress_bar_defaults_to_rank_zero(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert StepProgress(4).bar is None
    monkeypatch.setenv("RANK", "0")
    bar = StepProgress(4, file=io.StringIO())
    assert bar.bar is not None
    bar.close()


def test_truncate_after_a_resume_keeps_every_step_once(tmp_path):
    tracker = Tracker(["jsonl", "tensorboard"], tmp_path, rank=0)
    for step in (1, 2, 3):
        tracker.log({"x": float(step)}, step)
    tracker.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x": 4.')  # torn by the kill
    # The resumed run: checkpoint at step 1, so steps 2.. are trained (and logged) again.
    tracker = Tracker(["jsonl", "tensorboard"], tmp_path, rank=0)
    tracker.continue_after(1)
    for step in (2, 3):
        tracker.log({"x": 10.0 * step}, step)
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "x": 1.0}, {"step": 2, "x": 20.0}, {"step": 3, "x": 30.0}]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 20.0), (3, 30.0)]  # purge_step


def test_a_fresh_start_moves_an_earlier_runs_metrics_aside(tmp_path):
    with Tracker(["jsonl"], tmp_path, rank=0) as tracker:
        tracker.log({"x": 1.0}, 1)
    with Tracker(["jsonl"], tmp_path, rank=0) as tracker:
        tracker.continue_after(0)
        tracker.log({"x": 2.0}, 1)
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"step": 1, "x": 2.0}]
    aside = list(tmp_path.glob("metrics.*.jsonl"))
    assert len(aside) == 1 and json.loads(aside[0].read_text()) == {"step": 1, "x": 1.0}  # kept, not deleted
