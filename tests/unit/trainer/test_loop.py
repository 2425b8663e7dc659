"""The step loop itself (``RLTrainer.train_step``) and the feed it runs, on two gloo ranks, with a scripted source.

Each rank leads a rollout group and is one DP replica. The feed is the real one (:class:`Feed` and :class:`Roller`,
fresh rounds, scoring, the exchange of rows to their replicas, a dump step's return trip), built from the run's
config; only its source is :class:`~tests.helpers.sources.ScriptedSource` and the actor a recorder (no model: the
loop's algorithm around it is what is tested). One step: every sampled token reaches exactly one replica's update
with the rollout's log-probs, GRPO's advantages (the reward is the response's length, so a group's longer response
is the better one), the weight version bumped once, the rollout metrics reduced over both ranks, and the dump
written by the leaders with the trainer's advantages.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.helpers.distributed import run_distributed


class _Actor:
    """Records what the loop gives the actor; log-probs are the rollout's."""

    def __init__(self) -> None:
        self.updates: list[dict[str, torch.Tensor]] = []

    def compute_log_prob(self, batch: Any, calculate_entropy: bool = False) -> Any:
        return batch.update({"old_log_probs": batch["rollout_log_probs"].clone(),
                             "entropys": torch.zeros_like(batch["rollout_log_probs"])})

    def routing_metrics(self) -> dict[str, float]:
        return {}

    def update_policy(self, batch: Any, **kwargs: Any) -> dict[str, float]:
        self.updates.append({k: v.clone() for k, v in batch.tensors.items()})
        return {"pg_loss": 0.0}


class _WeightSync:
    """The sharding manager's surface the loop uses."""

    def __init__(self) -> None:
        from mcore_agentic.sharding.transports import WeightVersion

        self.version = WeightVersion()

    def __enter__(self) -> _WeightSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


def _step(rank: int, world_size: int, dumps: str) -> dict[str, Any]:
    import torch.distributed as dist

    from mcore_agentic.algorithms.kl import build_kl_controller
    from mcore_agentic.config import compose, load_config
    from mcore_agentic.config.rules import validate
    from mcore_agentic.feed import Feed, Roller
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer
    from mcore_agentic.parallel.rollout_placement import RolloutPlacement
    from mcore_agentic.trainer.build import Components, build_timer, feed_settings
    from mcore_agentic.trainer.loop import RLTrainer
    from tests.helpers.sources import ROWS, ScriptedSource

    cfg = load_config(compose("default_tiny", [
        "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=2",
        "algorithm.adv_estimator=grpo", f"trainer.rollout_data_dir={dumps}", "trainer.rollout_data_freq=1",
        "trainer.rollout_data_fraction=1.0", "rollout.multi_turn.tool_config_path=null"]), log_aliases=False)
    sizes = validate(cfg, world_size)
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    layout = SimpleNamespace(world_size=2, rank=rank, data_parallel_size=2, dp_rank=rank, replica_ranks=lambda d: [d],
                             replica_group=lambda: None, dp_group=lambda: dist.group.WORLD)
    timer, gpu = build_timer(cfg)
    sync = _WeightSync()
    settings = feed_settings(cfg, sizes)
    roller = Roller(settings, placement=RolloutPlacement(2, rank, 1), engine=None, tools={}, interactions={},
                    executor=None, tokenizer=tok, reward_fn=lambda source, text, truth, extra: float(len(text)),
                    timer=timer, version=lambda: sync.version.value)
    roller.new_source = lambda cfg=None, *, partial=False: ScriptedSource()  # the run's one choice of source
    feed = Feed(settings, roller, layout=layout, loader=[ROWS], val_rows=[])
    actor = _Actor()
    c = Components(cfg=cfg, layout=layout, sizes=sizes, tokenizer=tok, feed=feed, actor=actor, ref=None, teacher=None,
                   critic=None, weight_sync=sync, kl_ctrl=build_kl_controller(cfg.algorithm.kl_ctrl), total_steps=1,
                   timer=timer, gpu=gpu)
    trainer = RLTrainer(c, tracker=None, ckpt=None, progress_factory=None)
    feed.start()
    metrics = trainer.train_step(1)
    trainer.close()
    return {"updates": actor.updates, "version": sync.version.value,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, float | int)}}


def test_one_step_trains_every_sampled_token_once_with_grpo_advantages(tmp_path: Path) -> None:
    from mcore_agentic.feed.rollout_dump import read_dump
    from tests.helpers.sources import ROWS

    r0, r1 = run_distributed(_step, world_size=2, args=(str(tmp_path / "dumps"),), timeout=300)
    assert r0["version"] == r1["version"] == 1  # bumped once, after the actor's update
    assert r0["metrics"]["reward/mean"] == r1["metrics"]["reward/mean"]  # reduced over the world
    trained = []
    for r in (r0, r1):
        assert len(r["updates"]) == 1
        u = r["updates"][0]
        assert len(u["responses"]) == 4  # 8 sequences over 2 replicas
        for row in range(4):
            mask = u["response_mask"][row].bool()
            ids = u["responses"][row][mask].tolist()
            trained.append(ids)
            adv = u["advantages"][row][mask]
            assert torch.equal(u["rollout_log_probs"][row][mask], torch.full((len(ids),), -0.5))
            assert len(set(adv.tolist())) == 1  # one outcome advantage over the response
            assert (float(adv[0]) > 0) == (len(ids) == 6)  # the group's longer response is the better one
    scripts = [r["extra_info"]["script"] for r in ROWS]
    assert sorted(trained) == sorted([s for s in scripts] + [s[:-2] for s in scripts])  # each sample once
    dumped = [r for r in read_dump(tmp_path / "dumps").to_pylist() if r["split"] == "train"]
    assert len(dumped) == 8 and all(r["weight_version"] == 0 for r in dumped)
    for r in dumped:  # the trainer's advantages came back to the leader that dumped the row
        sampled = [a for a, m in zip(r["advantages"], r["response_mask"]) if m]
        assert sampled and (sampled[0] > 0) == (sum(r["response_mask"]) == 6)
