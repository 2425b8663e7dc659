"""``trainer.plan_check``: the launcher's verdict before any model is built (a GPU given explicitly here)."""

from __future__ import annotations

from mcore_agentic.plan.__main__ import compose
from mcore_agentic.plan.check import launch_check
from mcore_agentic.plan.devices import get_device

H100 = get_device("h100-80g")
BIG = ["trainer.device=cuda", "actor.ppo_micro_batch_size_per_gpu=8"]  # Qwen2.5-3B, 8 x 2048-token rows per micro-batch, TP=1


def test_error_refuses_in_one_line_naming_phase_rank_and_shortfall():
    cfg = compose("gsm8k_multiturn_grpo", [*BIG, "trainer.plan_check=error"])
    line, error = launch_check(cfg, 8, H100)
    assert line is None and error is not None
    text = str(error)
    assert text.startswith("trainer.plan_check: actor_update needs") and "\n" not in text
    assert "on rank 0" in text and "GiB short" in text


def test_warn_says_the_same_and_runs():
    cfg = compose("gsm8k_multiturn_grpo", [*BIG, "trainer.plan_check=warn"])
    line, error = launch_check(cfg, 8, H100)
    assert error is None and line.startswith("plan: WARNING, actor_update needs")


def test_a_smaller_micro_batch_fits():
    cfg = compose("gsm8k_multiturn_grpo", [*BIG, "trainer.plan_check=error", "actor.ppo_micro_batch_size_per_gpu=1",
                                           "ref.log_prob_micro_batch_size_per_gpu=1"])
    line, error = launch_check(cfg, 8, H100)
    assert error is None and line.startswith("plan: fits")


def test_off_cpu_or_no_gpu_plans_nothing():
    assert launch_check(compose("gsm8k_multiturn_grpo", [*BIG, "trainer.plan_check=off"]), 8, H100) == (None, None)
    assert launch_check(compose("default_tiny", ["trainer.device=cpu"]), 2, H100) == (None, None)
    assert launch_check(compose("default_tiny", []), 2, None) == (None, None)


def test_local_gpu_reads_nvidia_smi(tmp_path, monkeypatch):
    """No GPU here: a stand-in ``nvidia-smi`` prints what the real one prints for an H200 (its list, then the visible
    GPU's name and memory), and without one on PATH there is no GPU to plan for (more in test_local_gpu.py)."""
    from mcore_agentic.plan.check import local_gpu

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_gpu() is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nif [ \"$1\" = -L ]; then\n"
                   "echo 'GPU 0: NVIDIA H200 (UUID: GPU-3a1f0c9e-7b2d-4e65-9c18-5d4e2f7a0b93)'\n"
                   "echo 'GPU 1: NVIDIA H200 (UUID: GPU-e4c27b15-0a9f-4d3c-8b61-7f2a9d5c1e08)'\n"
                   "else echo 'NVIDIA H200, 143771'; fi\n")
    smi.chmod(0o755)
    gpu = local_gpu()
    assert gpu is not None and gpu.name == "NVIDIA H200 (as h200-141g)"
    assert abs(gpu.memory_gib - 143771 / 1024) < 1e-9 and gpu.hbm_tb_s == get_device("h200-141g").hbm_tb_s


def test_the_census_child_ends_with_the_check(monkeypatch):
    """GPU review P8: every torchrun rank runs the check; its census child (torch, megatron-core and transformers
    imported) must not stay for the whole run."""
    from mcore_agentic.plan import census

    started: list[census._Child] = []

    class Recorded(census._Child):
        def __init__(self) -> None:
            super().__init__()
            started.append(self)

    monkeypatch.setattr(census, "_Child", Recorded)
    monkeypatch.setattr(census, "_ANSWERS", {})  # nothing answered from memory: a child is started
    line, error = launch_check(compose("default_tiny", ["trainer.device=cuda", "trainer.plan_check=warn"]), 2, H100)
    assert error is None and line.startswith("plan: ")
    assert len(started) == 1 and census._CHILD is None
    assert started[0].proc.poll() is not None, "the census child outlived the launch check"


def _planner_dies(monkeypatch, mode: str):
    """The launcher's ``plan_check`` with a planner whose census child died (GPU review m1)."""
    import mcore_agentic.plan.check as check

    def dies(*args, **kwargs):
        raise RuntimeError("the model census failed:\nTraceback (most recent call last):\nMemoryError")

    monkeypatch.setattr(check, "launch_check", dies)
    monkeypatch.setattr(check, "local_gpu", lambda: H100)
    from launch.pretrain_rl import plan_check

    return plan_check(compose("default_tiny", ["trainer.device=cuda", f"trainer.plan_check={mode}"]), 2)


def test_a_failed_planner_warns_and_the_run_goes_on(monkeypatch, capsys):
    assert _planner_dies(monkeypatch, "warn") == []
    said = capsys.readouterr().err.strip()
    assert said == ("plan: WARNING, skipped: the planner failed (RuntimeError: the model census failed: ... "
                    "MemoryError); the run goes on")


def test_a_failed_planner_stops_an_error_check_in_one_line(monkeypatch, capsys):
    problems = _planner_dies(monkeypatch, "error")
    assert len(problems) == 1 and "\n" not in str(problems[0])
    assert str(problems[0]).startswith("trainer.plan_check: the planner failed (RuntimeError: ")
    assert capsys.readouterr().err == ""
