"""launch/export_hf.py finds the run's base model from any directory, and says which key and where when it cannot."""

from __future__ import annotations

import json

import pytest

from launch.export_hf import _base_path
from mcore_agentic.config.paths import REPO_ROOT


def test_a_recorded_relative_base_is_found_from_elsewhere_or_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "global_step_3"
    ckpt.mkdir()
    model = REPO_ROOT / "outputs" / "models" / "probe_export_base"
    model.mkdir(parents=True, exist_ok=True)
    try:
        (model / "config.json").write_text("{}")
        (ckpt / "config.json").write_text(json.dumps({"model": {"model_path": "outputs/models/probe_export_base"}}))
        assert _base_path(ckpt, None) == REPO_ROOT / "outputs/models/probe_export_base"  # the repository's, from tmp
    finally:
        (model / "config.json").unlink()
        model.rmdir()
    with pytest.raises(SystemExit) as info:
        _base_path(ckpt, None)
    line = str(info.value)
    assert line.startswith(f"error: model.model_path recorded in {ckpt / 'config.json'} is outputs/models/probe_export_base")
    assert str(tmp_path.resolve()) in line and "pass --base" in line and "\n" not in line
