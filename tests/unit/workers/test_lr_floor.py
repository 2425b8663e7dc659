"""The decay floor is relative: ``optim.min_lr_ratio`` (a fraction of lr, verl's key) or ``optim.min_lr`` (absolute,
Megatron's), never both (issue 50 item 5).

A verl user's ``actor_rollout_ref.actor.optim.lr=1e-6`` on the default job passes the launcher's pre-flight (the
job's absolute floor of 2e-4 refused it), a config that sets both keys is one line naming both, the default job's
floor is the 2e-4 it always was, and the scheduler megatron-core builds decays to ``lr x min_lr_ratio``.
"""

from __future__ import annotations

import pytest

from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.workers.config import OptimConfig
from tests.helpers.distributed import run_distributed
from tests.unit.workers._fixtures import make_tiny_hf


def _preflight(capsys, *argv: str) -> tuple[int, str, str]:
    from launch.pretrain_rl import parse_args, preflight_launch

    code = preflight_launch(parse_args(["--check", *argv]))
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


def test_the_verl_lr_override_on_the_default_job_passes_the_preflight(capsys):
    code, out, err = _preflight(capsys, "actor_rollout_ref.actor.optim.lr=1e-6")
    assert (code, out) == (0, "pre-flight passed: default_tiny on 1 rank(s)"), err
    assert "verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in err
    code, out, err = _preflight(capsys, "actor_rollout_ref.actor.optim.min_lr_ratio=0.1")  # verl's ratio: an alias
    assert code == 0 and "verl key actor_rollout_ref.actor.optim.min_lr_ratio -> actor.optim.min_lr_ratio" in err


def test_both_floors_set_is_one_line_naming_both_keys(capsys):
    code, _, err = _preflight(capsys, "actor.optim.min_lr=1e-5")  # the default job sets min_lr_ratio
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith("error: actor.optim.min_lr: 1e-05 and min_lr_ratio=") and "both set" in lines[0]
    code, out, _ = _preflight(capsys, "actor.optim.min_lr_ratio=null", "actor.optim.min_lr=1e-5")
    assert code == 0, out


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_lr": 1e-7, "min_lr_ratio": 0.1}, "min_lr"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ({"min_lr_ratio": -0.1}, "min_lr_ratio"),
])
def test_bad_floors_name_the_key(kwargs, field):
    with pytest.raises(ConfigError) as err:
        OptimConfig(lr=1e-6, **kwargs)
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_the_floor_follows_lr_unless_absolute():
    assert OptimConfig(lr=3e-3).floor_lr == 0.0
    assert OptimConfig(lr=1e-6, min_lr_ratio=0.1).floor_lr == pytest.approx(1e-7)
    assert OptimConfig(lr=1e-6, min_lr=5e-7).floor_lr == 5e-7


def test_the_default_job_keeps_its_floor():
    """``make train``'s schedule is unchanged: the ratio gives exactly the absolute floor it had (2e-4)."""
    from mcore_agentic.config import compose, load_config

    cfg = load_config(compose("default_tiny"))
    assert cfg.actor.optim.min_lr is None
    assert cfg.actor.optim.floor_lr == 2e-4 and cfg.actor.optim.lr == 3e-3


def _scheduler(rank: int, world_size: int, path: str) -> list[tuple[float, float]]:
    import megatron_patches
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.workers.megatron_model import MegatronModel

    megatron_patches.apply()
    out = []
    for optim in (OptimConfig(lr=3e-3, lr_decay_style="linear", lr_warmup_steps=0, min_lr_ratio=0.25),
                  OptimConfig(lr=3e-3, lr_decay_style="cosine", lr_warmup_steps=0, min_lr=1e-4)):
        par = ParallelConfig()
        layout = initialize_parallel(par, seed=1)
        model = MegatronModel(ModelSpec(path, "float32", parallel=par), layout, optim=optim, total_training_steps=4)
        model.scheduler.step(increment=4)  # the end of the decay
        lrs = {g["lr"] for g in model.optimizer.param_groups}
        floors = {g.get("min_lr", model.scheduler.min_lr) for g in model.optimizer.param_groups}
        assert len(lrs) == 1 and len(floors) == 1
        out.append((lrs.pop(), floors.pop()))
        del model
        destroy_parallel()
    return out


def test_the_built_scheduler_decays_to_lr_times_ratio(tmp_path):
    path = str(make_tiny_hf(tmp_path / "tiny"))
    (ratio_end, ratio_floor), (abs_end, abs_floor) = run_distributed(_scheduler, 1, args=(path,))[0]
    assert ratio_floor == ratio_end == pytest.approx(3e-3 * 0.25, rel=1e-12)
    assert abs_floor == abs_end == pytest.approx(1e-4, rel=1e-12)
