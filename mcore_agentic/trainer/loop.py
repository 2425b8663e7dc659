"""The PPO/GRPO step loop: the algorithm top to bottom, built by :mod:`.build`, maths in :mod:`.experience`.

One step: weight sync -> this replica's rows, from the feed (:mod:`mcore_agentic.feed`: prompts, rollouts and
rewards on the rollout leaders, the rows dealt to their replicas) -> old log-probs -> ref log-probs -> values ->
advantages -> critic update -> actor update -> metrics (reduced over ranks) -> checkpoint -> validation.
The loop holds no rollout state and asks no rank what role it has: that is the feed's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.algorithms.rollout_correction import compute_rollout_correction
from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.stats import Stats, max_over, sum_over
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.trainer import experience as exp
from mcore_agentic.trainer.build import Components, model_state_io
from mcore_agentic.trainer.preemption import StopSignals, TrainingStopped
from mcore_agentic.trainer.run_health import RunHealth, StepFailures

logger = logging.getLogger(__name__)


@dataclass
class LoopState:
    """What a checkpoint must restore besides models and RNGs."""

    step: int = 0
    """Completed RL steps."""
    sft_done: bool = False
    history: list[float] = field(default_factory=list)
    """Mean reward of each step (for the end-of-run summary)."""


class RLTrainer:
    """Runs the step loop over :class:`Components`; ``tracker``/``progress``/``ckpt`` are the bookkeeping."""

    def __init__(self, c: Components, tracker: Any, ckpt: Any, progress_factory: Any):
        self.c = c
        self.cfg = c.cfg
        self.tracker = tracker
        self.ckpt = ckpt
        self.progress_factory = progress_factory
        self.chat = ChatTokenizer(c.tokenizer)
        self.pad_id = int(c.tokenizer.pad_token_id if c.tokenizer.pad_token_id is not None else c.tokenizer.eos_token_id)
        self.state = LoopState()
        # The SFT warm start re-anchors the reference model: then it is checkpointed too.
        anchored_ref = c.ref if self.cfg.trainer.sft_warmup_steps > 0 else None
        self.writers, self.readers = model_state_io(c.actor, c.critic, anchored_ref, self.cfg.trainer.resume_optim_from)
        # Device memory / utilisation at the end of each phase, and what offload and release free (NVML; off on CPU).
        self.gpu, self.timer = c.gpu, c.timer
        # The rollout side of every step: prompts, rollouts, rewards, the rows to their replicas, dumps.
        self.feed = c.feed
        # The warm start renders demonstrations exactly as rollouts render their conversations.
        self.schemas = self.feed.tool_schemas() if self.cfg.rollout.multi_turn.tool_schemas_in_prompt else None
        if self.gpu.enabled and hasattr(c.weight_sync, "gpu"):
            c.weight_sync.gpu = self.gpu
        # What the feed carries across steps (partial rollouts: its buffer of requests in flight) is a checkpoint part.
        writers, readers = self.feed.checkpoint_parts()
        self.writers.update(writers)
        self.readers.update(readers)
        self.sft_summary: dict[str, float] = {}
        # Failure rates of every step (all-reduced): a run whose rollouts almost all fail stops with one line.
        self.health = RunHealth(self.cfg.trainer.failure_stop_fraction, self.cfg.trainer.failure_stop_steps)
        self.stop = StopSignals([])  # replaced by the installed one in fit()

    def close(self) -> None:
        """The feed finishes its queued dumps, releases paused requests' tools, stops the executor and the engine."""
        self.feed.close()

    # ----------------------------------------------------------------------------------- run
    def fit(self) -> LoopState:
        """Resume, warm-start, then run RL steps to ``total_steps``; a stop signal ends it with :class:`TrainingStopped`."""
        cfg = self.cfg.trainer
        with StopSignals(cfg.stop_signals, save_every_minutes=cfg.save_every_minutes) as stop:
            self.stop = stop
            self.maybe_resume()
            if stop.poll()[0]:  # signalled while the run was being built: nothing new to save
                raise TrainingStopped(self.state.step, stop.signal_name, None)
            if not self.state.sft_done:
                self.sft_warmup()
                periodic = cfg.save_freq > 0 or cfg.save_every_minutes is not None
                self.boundary(0, save=cfg.sft_warmup_steps > 0 and periodic and cfg.resume_mode != "disable")
            if cfg.val_before_train and self.state.step == 0:
                self.tracker.log(self.validate(), 0)
            progress = self.progress_factory(self.c.total_steps, self.state.step)
            self.feed.start()
            try:
                while self.state.step < self.c.total_steps:
                    step = self.state.step + 1
                    metrics = self.train_step(step)
                    self.state.step = step
                    self.state.history.append(metrics["reward/mean"])
                    if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == self.c.total_steps):
                        metrics.update(self.validate())
                    self.tracker.log(metrics, step)
                    progress.update(metrics)
                    self.health.observe(step, StepFailures.from_metrics(metrics), why=self.feed.failure_causes())
                    last = step == self.c.total_steps
                    periodic = cfg.save_freq > 0 and step % cfg.save_freq == 0
                    self.boundary(step, save=periodic or (last and cfg.resume_mode != "disable"), last=last)
            finally:
                progress.close()
        return self.state

    def run_notes(self) -> list[str]:
        """The end-of-run summary's failure lines, over every rollout leader (collective; identical on every rank)."""
        line = self.health.summary_line()
        return ([line] if line is not None else []) + self.feed.failure_lines()

    def boundary(self, step: int, *, save: bool, last: bool = False) -> None:
        """End of step ``step`` (0: the warm start): agree on stop / timed save across ranks, save, maybe stop."""
        stop, due = self.stop.poll()
        path = None
        if save or stop or due:
            path = self.save(step)
        if stop and not last:
            how = "run the same command" if self.cfg.trainer.resume_mode == "auto" else "run it with trainer.resume_mode=auto"
            raise TrainingStopped(step, self.stop.signal_name, str(path) if path is not None else None, how)

    def train_step(self, step: int) -> dict[str, Any]:
        c, t = self.c, self.timer
        start = time.perf_counter()
        with t.phase("step"):
            with t.phase("gen"), c.weight_sync:  # enter: the engine gets the actor's current weights
                rollout = self.feed.roll_out(step)  # the step's prompts rolled out and scored on the rollout leaders
            sync = c.weight_sync.metrics()
            with t.phase("distribute"):  # includes waiting for the slowest group's rollout
                fed = self.feed.hand_off(rollout)  # this replica's rows (tensors only) and the step's rollout metrics
            batch = fed.rows.batch()
            with t.phase("old_log_prob"):
                batch = c.actor.compute_log_prob(batch, calculate_entropy=True)
                sync.update(c.actor.routing_metrics())  # rollout/routing_agreement (actor.moe.routing_replay)
            if c.ref is not None:
                with t.phase("ref"):
                    batch = c.ref.compute_ref_log_prob(batch)
            if c.teacher is not None:
                with t.phase("teacher"):
                    batch = c.teacher.compute_teacher_log_prob(batch, top_k=self.cfg.algorithm.distillation.top_k)
            if c.critic is not None:
                with t.phase("values"):
                    c.critic.reload()  # no-op unless critic.*_offload moved it away after the last update
                    batch = c.critic.compute_values(batch)
            with t.phase("adv"):
                batch, adv_metrics = exp.compute_experience(
                    batch, self.cfg.algorithm, c.kl_ctrl, reduce=sum_over(self.dp_group), num_groups=fed.num_rows
                )
            update_metrics = self.feed.give_back(fed, batch)  # a dump step: the trainer's values go to the leaders
            if c.critic is not None:
                with t.phase("update_critic"):
                    update_metrics.update(prefix("critic/", c.critic.update_critic(batch, **self.mini_batch(fed, "critic"))))
                    c.critic.offload()  # what critic.*_offload names stays off the device until the next step
            if c.critic is None or step > self.cfg.critic.warmup_steps:
                with t.phase("update_actor"):
                    actor_batch, loss_metrics = self.actor_batch(batch)
                    update_metrics.update(loss_metrics)
                    distill = self.cfg.algorithm.distillation if c.teacher is not None else None
                    update_metrics.update(prefix("actor/", c.actor.update_policy(
                        actor_batch, distillation=distill, **self.mini_batch(fed, "actor"))))
                c.weight_sync.version.bump()  # the engine must resync before the next rollout
        extra = {**adv_metrics, **update_metrics, **sync}
        return self.step_metrics(batch, fed.metrics, extra, time.perf_counter() - start)

    def mini_batch(self, fed: Any, role: str) -> dict[str, int]:
        """The step's mini-batch size when its rows are not ``sequences_per_step`` (agent episodes that trained
        several samples): as many mini-batches as configured, each holding its share; {} otherwise."""
        sizes = self.c.sizes
        if fed.num_rows == sizes.sequences_per_step:
            return {}
        per_role = sizes.actor if role == "actor" else sizes.critic
        return {"mini_batch_size": fed.num_rows // per_role.mini_batches_per_epoch}

    def actor_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The actor's batch: truncated rows out of the policy loss under ``algorithm.overlong_filtering``, then
        the rollout correction (the critic keeps the batch as it was); plus their metrics."""
        metrics: dict[str, float] = {}
        if self.cfg.algorithm.overlong_filtering:
            truncated = batch["truncated"].bool()
            st = Stats().add("truncated", truncated.float()).reduce(self.dp_group)
            metrics["actor/overlong_filtered_fraction"] = st.mean("truncated")
            batch = batch.update({"response_mask": batch["response_mask"] * (~truncated).long().unsqueeze(-1)})
        batch, corr = self.rollout_correction(batch)
        return batch, {**metrics, **corr}

    def rollout_correction(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The actor's batch under ``algorithm.rollout_correction``: importance weights and the rejection mask
        of its policy loss (the critic keeps the batch as it was), and the correction's metrics."""
        cfg = self.cfg.algorithm.rollout_correction
        if not cfg.enabled:
            return batch, {}
        corr = compute_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], cfg,
            reduce=sum_over(self.dp_group), reduce_max=max_over(self.dp_group),
            token_ages=batch["token_ages"] if "token_ages" in batch else None,
        )
        tensors = {"response_mask": corr.mask}
        if cfg.rollout_is is not None:
            tensors["rollout_is_weights"] = corr.weights
        return batch.update(tensors), corr.metrics

    @property
    def dp_group(self) -> Any:
        """The group that sums over DP replicas (one rank per replica); None with one replica."""
        return self.c.layout.dp_group() if self.c.layout.data_parallel_size > 1 else None

    def step_metrics(self, batch: Batch, rollout: dict[str, float], extra: dict[str, float], seconds: float) -> dict[str, Any]:
        """The step's metrics on every rank: the feed's rollout metrics (reduced over the world), this replica's
        rows' statistics reduced over DP, the updates' (already global) and timings."""
        m: dict[str, Any] = dict(rollout)
        m.update(exp.rollout_vs_train_metrics(batch, self.dp_group))
        m.update(exp.compute_data_metrics(batch, self.cfg.data.max_response_length, self.dp_group))
        m.update(extra)
        m.update(self.timer.pop())  # and, on GPUs, the device readings at each phase's end
        m.update(self.sft_summary)  # once: with the first RL step after the warm start
        self.sft_summary = {}
        tokens = Stats().add("tokens", batch["attention_mask"].sum().reshape(1)).reduce(self.dp_group).total("tokens")
        m.update(exp.throughput_metrics(int(tokens), seconds, self.c.layout.world_size))
        return m

    # ----------------------------------------------------------------------------------- SFT
    def sft_warmup(self) -> None:
        """Warm start before RL step 1; its summary is logged with step 1's metrics (``sft/*``)."""
        steps = self.cfg.trainer.sft_warmup_steps
        if steps > 0:
            from mcore_agentic.trainer.sft import demonstrations, run_sft_warmup

            with self.timer.phase("sft"):
                history = run_sft_warmup(
                    self.c.actor, demonstrations(self.cfg), self.chat, self.schemas,
                    steps=steps, batch_size=self.c.sizes.sequences_per_step, seed=self.cfg.seed,
                    pad_token_id=self.pad_id, max_length=self.cfg.data.max_sequence_length,
                    log=self._sft_progress,
                )
            self.sft_summary = {
                "sft/steps": float(steps),
                "sft/loss_first": history[0]["sft/sft_loss"],
                "sft/loss_last": history[-1]["sft/sft_loss"],
                **self.timer.pop(),
            }
            logger.info("SFT warm start: %s", self.sft_summary)
            self.c.weight_sync.version.bump()
            if self.c.ref is not None:  # the KL anchor is the warm-started policy, as after any SFT
                self.c.ref.load_hf_weights(self.c.actor.export_hf_weights())
        self.state.sft_done = True

    def _sft_progress(self, metrics: dict[str, float], step: int) -> None:
        steps = self.cfg.trainer.sft_warmup_steps
        every = max(1, steps // 6)
        if self.c.layout.rank == 0 and ((step + 1) % every == 0 or step + 1 == steps):
            print(f"SFT warm start {step + 1}/{steps}: loss {metrics['sft/sft_loss']:.4f}", flush=True)

    # ----------------------------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Greedy single-sample rollout of the validation prompts (the feed's); mean reward/accuracy."""
        c = self.c
        if not self.feed.has_validation:
            return {}
        with self.timer.phase("validate"):
            with c.weight_sync:
                val = self.feed.roll_out_validation(self.state.step)
            out = self.feed.validation_metrics(val)
        readings = self.timer.pop()  # the validation's own device readings too (the step's were popped already)
        out["timing_s/validate"] = readings.get("timing_s/validate", 0.0)
        out.update({k: v for k, v in readings.items() if not k.startswith("timing_s/")})
        return out

    # ----------------------------------------------------------------------------------- checkpoints
    def save(self, step: int) -> Any:
        state = {
            "loop": dataclasses.asdict(self.state),
            "dataloader": self.feed.loader_state(),
            "kl_coef": float(self.c.kl_ctrl.value),
            # Partial rollouts record the version that sampled each token: it must continue, not restart.
            "weight_version": int(self.c.weight_sync.version.value),
        }
        from mcore_agentic.utils.walk import to_dict

        with self.timer.phase("save_checkpoint"):
            path = self.ckpt.save(step, state, writers=self.writers, config=to_dict(self.cfg))
        self.stop.saved()
        return path

    def maybe_resume(self) -> None:
        """Load the checkpoint ``trainer.resume_mode`` names, verified (see :meth:`CheckpointManager.resolve`)."""
        t = self.cfg.trainer
        path = self.ckpt.resolve(t.resume_mode, t.resume_from_path)
        if path is None:
            self.tracker.continue_after(0)  # a fresh start: an earlier run's metrics.jsonl is moved aside
            return
        from mcore_agentic.trainer.checkpoint import STEP_PREFIX
        from mcore_agentic.trainer.resume_report import RunComplete, config_changes, describe_changes, saved_config
        from mcore_agentic.utils.walk import to_dict

        saved_step = int(path.name[len(STEP_PREFIX):]) if path.name.startswith(STEP_PREFIX) else -1
        if saved_step >= self.c.total_steps:
            raise RunComplete(saved_step, str(path))
        rank0 = self.c.layout.rank == 0
        saved = saved_config(path) if rank0 else None
        if saved is not None:
            changes = config_changes(saved, to_dict(self.cfg))
            if changes:
                lines = describe_changes(changes, t.resume_optim_from)
                print(f"resuming from {path}: {len(changes)} setting(s) changed since it was saved:\n" + "\n".join(lines),
                      flush=True)
        loaded = self.ckpt.load(path, readers=self.readers)
        s = loaded.trainer_state
        self.state = LoopState(**s["loop"])
        self.feed.load_loader_state(s["dataloader"])
        self.c.kl_ctrl.value = s["kl_coef"]
        self.c.weight_sync.version.value = int(s.get("weight_version", self.state.step + int(self.state.sft_done)))
        self.tracker.continue_after(self.state.step)  # the steps after it are re-run: each is logged once
        self.timer.pop()
        if self.c.layout.rank == 0:
            print(f"resumed from {path} at step {self.state.step}", flush=True)


def prefix(p: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{p}{k}": v for k, v in metrics.items()}
