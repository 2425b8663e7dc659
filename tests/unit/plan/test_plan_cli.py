"""``python -m mcore_agentic.plan`` on every config in ``configs/`` and every model preset: a table or JSON, the
peak phase, a verdict and step-time terms; bad input gets one line naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_agentic.plan.__main__ import main

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TOP = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem != "ppo_trainer")  # ppo_trainer: the base, no model
PRESETS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))


def _plan_json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("config", TOP)
def test_every_config_prints_a_table(config, capsys):
    assert main(["--config-name", config, "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    for phase in ("rollout", "weight_sync", "log_probs", "actor_update", "<- peak", "step time"):
        assert phase in out, (config, phase)
    assert "-> fits" in out or "does NOT fit" in out


@pytest.mark.parametrize("preset", PRESETS)
def test_every_model_preset_on_8_h100(preset, capsys):
    nodes = "4" if preset == "qwen3_30b_a3b" else "1"
    plan = _plan_json(capsys, ["--config-name", "gsm8k_multiturn_grpo", f"model={preset}", "--nodes", nodes,
                               "--suggest", "0"])  # suggestions are tested once, below (a large MoE's take minutes)
    assert plan["world_size"] == int(nodes) * 8
    assert plan["peak_bytes"] == max(p["bytes"] for p in plan["phases"])
    for phase in plan["phases"]:
        assert phase["bytes"] == sum(phase["parts"].values()) > 0
    assert plan["fits"] == (plan["peak_bytes"] <= plan["capacity_bytes"] * (1 - plan["headroom"]))
    assert sum(plan["step_seconds"].values()) > 0


def test_the_shipped_config_of_a_real_model_fits_the_gpus_its_header_names(capsys):
    """gsm8k_multiturn_grpo (Qwen2.5-3B) says ``--nproc_per_node 8``: it fits 8 H100s as shipped."""
    assert "--nproc_per_node 8" in (CONFIGS / "gsm8k_multiturn_grpo.yaml").read_text()
    plan = _plan_json(capsys, ["--config-name", "gsm8k_multiturn_grpo", "--device", "h100-80g", "--suggest", "0"])
    assert plan["world_size"] == 8 and plan["fits"]


def test_bad_device_is_one_line(capsys):
    assert main(["--device", "a100-40g"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "plan.device" in err and "h100-80g" in err


def test_unknown_model_without_config_json_is_one_line(capsys, tmp_path):
    assert main([f"model.model_path={tmp_path / 'MyModel-7B'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.model_path" in err and "config.json" in err


def test_a_run_that_does_not_fit_gets_suggestions_that_do(capsys):
    """gsm8k_multiturn_grpo (Qwen2.5-3B, TP=1) with 16 rows of 2048 tokens per micro-batch does not fit 8 H100s;
    each suggestion, applied as overrides and planned again, does."""
    from mcore_agentic.plan.__main__ import compose
    from mcore_agentic.plan.check import plan_for

    big = ["actor.ppo_micro_batch_size_per_gpu=16"]
    plan = _plan_json(capsys, ["--config-name", "gsm8k_multiturn_grpo", *big, "--suggest", "2"])
    assert not plan["fits"] and len(plan["suggestions"]) == 2
    steps = [s["step_seconds"] for s in plan["suggestions"]]
    assert steps == sorted(steps)
    for suggestion in plan["suggestions"]:
        again = plan_for(compose("gsm8k_multiturn_grpo", [*big, *suggestion["overrides"]]), world_size=8)
        assert again.fits and again.peak.bytes == suggestion["peak_bytes"], suggestion["overrides"]


LONG_ROWS = ["--config-name", "gsm8k_multiturn_grpo", "model=qwen3_8b", "data.max_prompt_length=2048",
             "data.max_response_length=30720", "actor.ppo_micro_batch_size_per_gpu=1",
             "ref.log_prob_micro_batch_size_per_gpu=1"]


def test_recomputation_is_planned_and_suggested_for_32k_token_rows(capsys):
    """Qwen3-8B with 32k-token rows on 8 H100s (the preset's TP=2): without recomputation one row's activations do
    not fit; with full recomputation they do, at the price of one more forward pass per update in the step time.
    The suggestions for the run without it each recompute or keep the optimizer on the host (what frees the update's
    memory: more model parallelism alone does not), recomputation among them, and each fits when planned again."""
    from mcore_agentic.plan.__main__ import compose
    from mcore_agentic.plan.check import plan_for

    without = _plan_json(capsys, [*LONG_ROWS, "--suggest", "3"])
    full = _plan_json(capsys, [*LONG_ROWS, "actor.recompute_granularity=full", "--suggest", "0"])
    assert not without["fits"] and full["fits"]
    update = {p["name"]: p for p in without["phases"]}["actor_update"]["bytes"]
    assert {p["name"]: p for p in full["phases"]}["actor_update"]["bytes"] < update / 2
    term = "activation recomputation (FLOPs / MFU)"
    assert term not in without["step_seconds"] and full["step_seconds"][term] > 0
    assert without["suggestions"]
    assert any("actor.recompute_granularity=full" in s["overrides"] for s in without["suggestions"])
    for suggestion in without["suggestions"]:
        assert {"actor.recompute_granularity=full", "actor.optim.optimizer_cpu_offload=true"} & set(
            suggestion["overrides"]), suggestion["overrides"]
        again = plan_for(compose("gsm8k_multiturn_grpo", [*LONG_ROWS[2:], *suggestion["overrides"]]), world_size=8)
        assert again.fits, suggestion["overrides"]


def test_the_table_says_what_the_engine_holds(capsys):
    assert main(["--config-name", "gsm8k_multiturn_grpo", "--suggest", "1"]) == 0
    out = capsys.readouterr().out
    assert "engine:" in out and "KV cache" in out and "sequences of the longest length at once" in out
    assert "layouts that fit, fastest first" in out


def test_a_teacher_on_its_own_split_is_planned_at_its_own_size(capsys):
    """A Qwen3-8B teacher beside a Qwen3-8B student at TP=2: split like the actor it holds half its weights on every
    GPU; on its own TP=8 (``teacher.tensor_model_parallel_size``) an eighth."""
    def others(own: str) -> int:
        plan = _plan_json(capsys, ["--config-name", "gsm8k_multiturn_grpo", "model=qwen3_8b",
                                   "actor.tensor_model_parallel_size=2", "teacher.model_path=models/Qwen3-8B",
                                   f"teacher.tensor_model_parallel_size={own}", "--suggest", "0"])
        (update,) = [p for p in plan["phases"] if p["name"] == "actor_update"]
        return update["parts"]["others left on the GPU"]

    with_actor, own = others("null"), others("8")
    assert with_actor == pytest.approx(4 * own, rel=0.01)
    assert own == pytest.approx(8.19e9 * 2 / 8, rel=0.01)  # Qwen3-8B's parameters in bf16, over 8 GPUs


def test_qwen3_30b_a3b_with_32k_token_rows_fits_4_nodes_of_8_h100_with_recomputation(capsys):
    """The MoE preset (TP1 EP8, its offload keys) with one 32k-token row per micro-batch on 32 H100s: full
    recomputation and the default chunked logits make it fit; without recomputation it does not."""
    long = [*LONG_ROWS[:2], "model=qwen3_30b_a3b", *LONG_ROWS[3:], "--nodes", "4", "--suggest", "0"]
    assert not _plan_json(capsys, long)["fits"]
    plan = _plan_json(capsys, [*long, "actor.recompute_granularity=full"])
    assert plan["world_size"] == 32 and plan["fits"], plan["peak_bytes"] / 2**30



def test_the_host_optimizer_frees_the_masters_and_moments_for_a_host_step(capsys):
    """``actor.optim.optimizer_cpu_offload``: the update no longer holds the fp32 masters and Adam moments (all of
    them, or the fraction not on the host), and the step time gains the host step (gradients down, params up, Adam
    on the CPU)."""
    base = ["--config-name", "gsm8k_multiturn_grpo", "model=qwen3_8b", "actor.optimizer_offload=false", "--suggest", "0"]
    term = "host optimizer (grads down, params up, CPU Adam)"

    def update(extra: list[str]) -> tuple[dict, dict]:
        plan = _plan_json(capsys, [*base, *extra])
        return {p["name"]: p for p in plan["phases"]}["actor_update"], plan["step_seconds"]

    (device, device_s), (host, host_s) = update([]), update(["actor.optim.optimizer_cpu_offload=true"])
    (half, half_s) = update(["actor.optim.optimizer_cpu_offload=true", "actor.optim.optimizer_offload_fraction=0.5"])
    optimizer = device["parts"]["actor master params"] + device["parts"]["actor Adam"]
    assert optimizer > 0 and host["parts"]["actor master params"] == host["parts"]["actor Adam"] == 0
    assert device["bytes"] - host["bytes"] == optimizer
    assert half["parts"]["actor Adam"] == pytest.approx(device["parts"]["actor Adam"] / 2, abs=1)
    assert term not in device_s and host_s[term] == pytest.approx(2 * half_s[term])


def test_separate_placement_is_planned_on_both_sides_and_its_split_suggested(capsys):
    """``rollout.placement=separate``: the trainer's GPUs hold no engine, a rollout rank holds its share, the weights
    cross a link, and the step is the slower side (generation runs while the trainer trains). ``--placements``
    ranks colocated against every split of the GPUs the run's rules allow."""
    base = ["--config-name", "gsm8k_multiturn_grpo", "model=qwen3_8b", "actor.optimizer_offload=false",
            "actor.param_offload=false", "actor.grad_offload=false", "--suggest", "0"]
    separate = _plan_json(capsys, [*base, "rollout.placement=separate", "rollout.rollout_ranks=2"])
    phases = {p["name"]: p for p in separate["phases"]}
    assert phases["rollout"]["parts"]["engine (gpu_memory_utilization)"] == 0
    assert phases["rollout_rank"]["parts"]["engine (gpu_memory_utilization)"] > 0 and phases["rollout_rank"]["rank"] == 6
    seconds = separate["step_seconds"]
    generation = sum(v for k, v in seconds.items() if k.startswith("rollout "))
    assert seconds["weight transfer to the rollout ranks (gloo through the host)"] > 0
    assert separate["total_seconds"] == pytest.approx(max(generation, sum(seconds.values()) - generation))
    assert "separate: 6 train + 2 rollout ranks" in separate["layout"] and separate["world_size"] == 8

    ranked = _plan_json(capsys, [*base, "--placements"])["placements"]
    ranks = [o["rollout_ranks"] for o in ranked]
    assert 0 in ranks and len(ranks) == len(set(ranks)) > 1  # colocated and at least one split
    fitting = [o for o in ranked if o["fits"]]
    assert fitting == sorted(fitting, key=lambda o: o["total_seconds"]) and ranked[: len(fitting)] == fitting
