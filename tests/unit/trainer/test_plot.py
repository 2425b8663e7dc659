"""End-of-run curves from metrics.jsonl: PNGs written, torn lines and resumed steps handled."""

from __future__ import annotations

import json

import matplotlib.image as mpimg

from mcore_agentic.trainer.logger import Tracker
from mcore_agentic.trainer.plot import plot_curves, read_metrics


def test_curves_written_from_tracker_output(tmp_path):
    with Tracker(["jsonl"], tmp_path, rank=0) as tracker:
        for step in range(1, 11):
            metrics = {"critic/score/mean": step / 10, "response_length/mean": 40 - step}
            if step % 5 == 0:
                metrics["val/test_score/synthetic/tool_arith"] = step / 12
            tracker.log(metrics, step)
    paths = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["response_length_curve.png", "reward_curve.png"]
    for p in paths:
        image = mpimg.imread(p)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0  # something was drawn


def test_read_metrics_skips_torn_line_and_keeps_latest_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"step": 1, "critic/score/mean": 0.1}),
        json.dumps({"step": 2, "critic/score/mean": 0.2}),
        json.dumps({"step": 2, "critic/score/mean": 0.3}),  # re-logged after a resume
        '{"step": 3, "critic/sco',  # killed mid-write
    ]
    path.write_text("\n".join(lines))
    records = read_metrics(path)
    assert [(r["step"], r["critic/score/mean"]) for r in records] == [(1, 0.1), (2, 0.3)]


def test_no_data_no_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "other": 1.0}) + "\n")
    assert plot_curves(path) == []
