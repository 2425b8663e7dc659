"""No per-row Python object crosses a rank boundary on the step path.

One real RL step of the default job on 2 gloo ranks (DP=2, two rollout engines) with
torch.distributed's object collectives (``all_gather_object``, ``broadcast_object_list``,
``gather_object``, ``scatter_object_list``) wrapped to record the pickled size of every call
made inside ``RLTrainer.train_step``. Rows move as tensors (``feed.distribute``), metrics as
all-reduced sums. Allowed: a few small fixed-size objects per step (at most
``MAX_CALLS`` calls of at most ``MAX_BYTES`` each, none growing with the batch): with PP=2 the
last stage shares its output keys and metric sums with the first (tens of bytes), and the
weight export shares each stage's parameter names and shapes (per model, ~0.5 KB here).
At DP=2, PP=1 there are none, also on a step that dumps its trajectories (the trainer's values go back to
the rollout leaders as tensors, `distribute.return_rows`) and distils from a teacher on its own TP=2 (one block
over both replicas: their rows reach it as tensors).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_default_job import ROOT, job_overrides

MAX_CALLS = 8
MAX_BYTES = 4096


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_train_step_sends_no_per_row_objects(tmp_path: Path, layout: str) -> None:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RECORD_OBJECTS_DIR": str(record_dir)}
    extra = ["trainer.total_training_steps=1", "trainer.sft_warmup_steps=0", "trainer.test_freq=-1",
             "trainer.save_freq=-1", "trainer.logger=[console,jsonl]", "data.train_batch_size=8", "rollout.n=2",
             "actor.ppo_mini_batch_size=4", "data.max_response_length=48", "data.synthetic.num_val=4"]
    if layout == "pp2":  # the pipeline's last stage shares its output keys and metric sums (small objects)
        extra += ["actor.pipeline_model_parallel_size=2"]
    else:  # a dump step too: the trainer's values go back to the leaders as tensors (distribute.return_rows);
        # and a distillation teacher on its own TP=2 over both replicas (its block gathers their rows as tensors)
        extra += [f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", "trainer.rollout_data_freq=1",
                  "teacher.model_path=${model.model_path}", "teacher.tensor_model_parallel_size=2",
                  "algorithm.distillation.top_k=4"]
    overrides = [o for o in job_overrides(tmp_path, extra)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "e2e" / "_record_object_collectives.py"), *overrides]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert rows["rollout/num_sequences"] == 16  # the step really moved 16 rows (8 per replica)
    if layout == "dp2":
        assert rows["dump/failed"] == 0 and len(list((tmp_path / "rollouts" / "train").glob("*.parquet"))) == 2
        assert "timing_s/teacher" in rows and rows["actor/distill_kl"] >= 0.0
    for rank in (0, 1):
        calls = json.loads((record_dir / f"rank{rank}.json").read_text())
        assert len(calls) <= MAX_CALLS, calls
        if layout == "dp2":
            assert calls == [], calls
        else:
            assert calls, "the recorder saw nothing: is it wrapping the collectives?"
        for call in calls:
            assert 0 <= call["bytes"] <= MAX_BYTES, call
