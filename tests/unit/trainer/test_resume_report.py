"""What a resume says about the settings that changed since the checkpoint, and whose value wins."""

from __future__ import annotations

import json

from mcore_agentic.config import compose, load_config
from mcore_agentic.trainer.resume_report import RunComplete, config_changes, describe_changes, saved_config
from mcore_agentic.utils.walk import to_dict


def test_changed_keys_are_listed_and_optimizer_ones_say_whose_value_wins(tmp_path):
    saved = to_dict(load_config(compose("default_tiny")))
    (tmp_path / "config.json").write_text(json.dumps(saved, indent=2, default=str))
    now = to_dict(load_config(compose("default_tiny", [
        "actor.optim.lr=1e-3", "actor.optim.clip_grad=0.5", "trainer.total_training_steps=60", "rollout.n=8",
        "trainer.resume_mode=disable",  # differs on purpose between the runs: never listed
    ])))
    changes = config_changes(saved_config(tmp_path), now)
    assert [key for key, _, _ in changes] == [
        "actor.optim.clip_grad", "actor.optim.lr", "rollout.n", "trainer.total_training_steps",
    ]
    lines = describe_changes(changes, "checkpoint")
    assert lines[1] == "  actor.optim.lr: 0.003 -> 0.001: the checkpoint's is used (trainer.resume_optim_from=config uses yours)"
    assert lines[0].endswith(": yours is used")  # the gradient clip is read from the config at every step
    assert lines[2] == "  rollout.n: 4 -> 8: yours is used"
    assert "decay horizon stays the checkpoint's" in lines[3]
    assert describe_changes(changes, "config")[1].endswith("yours is used (trainer.resume_optim_from=config)")
    # A setting added since the checkpoint was written, and a relative input path now stored absolute: no change.
    older = json.loads(json.dumps(saved, default=str))
    del older["trainer"]["failure_stop_steps"]
    older["rollout"]["multi_turn"]["tool_config_path"] = "configs/tools/meter_tool_config.yaml"
    assert config_changes(older, saved) == []


def test_unreadable_saved_config_and_the_complete_line(tmp_path):
    assert saved_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert saved_config(tmp_path) is None
    line = str(RunComplete(40, "ckpt/global_step_40"))
    assert line.startswith("already complete at step 40 (ckpt/global_step_40): nothing to do (new trainer.experiment_name, "
                           "or trainer.resume_mode=disable")
