"""The PPO/GRPO step loop: the algorithm top to bottom, built by :mod:`.build`, maths in :mod:`.experience`.

One step: prompts -> weight sync (context manager) -> rollout and rewards of this rollout group's prompts
(on its leader; one round, dynamic-sampling rounds or partial-rollout rounds: :mod:`.collect`) ->
rows to the DP replica that trains them (:mod:`.distribute`) ->
old log-probs -> ref log-probs -> values -> advantages -> critic update -> actor update ->
metrics (reduced over ranks) -> checkpoint -> validation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.algorithms.rollout_correction import compute_rollout_correction
from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel import comm
from mcore_agentic.parallel.stats import Stats, max_over, sum_over
from mcore_agentic.rollout.driver import mismatch_line
from mcore_agentic.rollout.failures import FailureReport, summarize_failures
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.trainer import experience as exp
from mcore_agentic.trainer.build import Components, model_state_io, tool_schemas
from mcore_agentic.trainer.collect import SEED_STRIDE, RolloutCollector
from mcore_agentic.trainer.distribute import StepPlan, exchange_rows, gather_shapes, plan_step, return_rows, tag_groups
from mcore_agentic.trainer.metrics import compute_data_metrics, throughput_metrics
from mcore_agentic.trainer.preemption import StopSignals, TrainingStopped
from mcore_agentic.trainer.rollout_dump import TRAINER_FIELDS, DumpWriter, dump_rows
from mcore_agentic.trainer.run_health import RunHealth, StepFailures
from mcore_agentic.utils.gpu_metrics import gpu_metrics_for
from mcore_agentic.utils.timing import PhaseTimer

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
        # The warm start renders demonstrations exactly as rollouts render their conversations.
        self.schemas = tool_schemas(c.tools) if self.cfg.rollout.multi_turn.tool_schemas_in_prompt else None
        self.pad_id = int(c.tokenizer.pad_token_id if c.tokenizer.pad_token_id is not None else c.tokenizer.eos_token_id)
        self.state = LoopState()
        # The SFT warm start re-anchors the reference model: then it is checkpointed too.
        anchored_ref = c.ref if self.cfg.trainer.sft_warmup_steps > 0 else None
        self.writers, self.readers = model_state_io(c.actor, c.critic, anchored_ref, self.cfg.trainer.resume_optim_from)
        # Device memory / utilisation at the end of each phase, and what offload and release free (NVML; off on CPU).
        self.gpu = gpu_metrics_for(self.cfg.trainer.device)
        self.timer = PhaseTimer(on_end=self.gpu.phase_end if self.gpu.enabled else None)
        if self.gpu.enabled and hasattr(c.weight_sync, "gpu"):
            c.weight_sync.gpu = self.gpu
        # Each step's rollout; under partial rollouts its buffer of requests in flight is a checkpoint part.
        self.collector = RolloutCollector(c, self.chat, self.timer, self.pad_id)
        if self.cfg.rollout.partial_rollout.enable:
            self.writers["rollout_buffer"] = self.collector.save_buffer
            self.readers["rollout_buffer"] = self.collector.load_buffer
        self.sft_summary: dict[str, float] = {}
        # Failure rates of every step (all-reduced): a run whose rollouts almost all fail stops with one line.
        self.health = RunHealth(self.cfg.trainer.failure_stop_fraction, self.cfg.trainer.failure_stop_steps)
        self.failures = FailureReport()  # this leader's, over the run (the end-of-run summary gathers them)
        self.last_failures = FailureReport()
        self.stop = StopSignals([])  # replaced by the installed one in fit()
        t = self.cfg.trainer
        # Every rank takes part in a dump step's return exchange; only rollout leaders write.
        self.dumps = t.rollout_data_dir is not None
        self.dump_writer = (
            DumpWriter(queue_size=t.rollout_data_queue_size, wait_s=t.rollout_data_wait_s)
            if self.dumps and c.placement.is_leader else None
        )

    def close(self) -> None:
        """Finish writing queued trajectory dumps; release the paused requests' tools and interactions."""
        if self.dump_writer is not None:
            self.dump_writer.close()
        self.collector.close()

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
            self.collector.start()
            try:
                while self.state.step < self.c.total_steps:
                    step = self.state.step + 1
                    metrics = self.train_step(self.collector.next_prompts(), step)
                    self.state.step = step
                    self.state.history.append(metrics["reward/mean"])
                    if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == self.c.total_steps):
                        metrics.update(self.validate())
                    self.tracker.log(metrics, step)
                    progress.update(metrics)
                    self.health.observe(step, StepFailures.from_metrics(metrics), why=self.failure_causes())
                    last = step == self.c.total_steps
                    periodic = cfg.save_freq > 0 and step % cfg.save_freq == 0
                    self.boundary(step, save=periodic or (last and cfg.resume_mode != "disable"), last=last)
            finally:
                progress.close()
        return self.state

    def report_rollout(self, batches: list[Batch], step: int, split: str) -> None:
        """On a rollout leader: this step's failed requests and failing tools (one warning each, with the first
        traceback) and its tokenization sanity-check mismatches (one line), added to the run's totals."""
        report = FailureReport()
        for b in batches:
            report.merge(summarize_failures(b.meta))
        report.log(logger, step, split)
        if split == "train":  # the stop rule and the run's totals count training rollouts (validation is logged)
            self.last_failures = report
            self.failures.merge(report)
        meta = {"request_metrics": [m for b in batches for m in b.meta.get("request_metrics", [])]}
        line = mismatch_line(meta)
        if line is not None:
            logger.warning("step %d (%s): %s", step, split, line)

    def run_notes(self) -> list[str]:
        """The end-of-run summary's failure lines, over every rollout leader (collective; identical on every rank)."""
        line = self.health.summary_line()
        notes = [line] if line is not None else []
        merged = FailureReport()
        for report in comm.all_gather_object(self.failures if self.c.placement.is_leader else None):
            if report is not None:
                merged.merge(report)
        return notes + merged.summary_lines()

    def failure_causes(self) -> str:
        """What this rank's rollouts of the last step say failed (its leader's tools and errors), for the stop line."""
        return "; ".join(self.last_failures.summary_lines()[:3])

    def boundary(self, step: int, *, save: bool, last: bool = False) -> None:
        """End of step ``step`` (0: the warm start): agree on stop / timed save across ranks, save, maybe stop."""
        stop, due = self.stop.poll()
        path = None
        if save or stop or due:
            path = self.save(step)
        if stop and not last:
            how = "run the same command" if self.cfg.trainer.resume_mode == "auto" else "run it with trainer.resume_mode=auto"
            raise TrainingStopped(step, self.stop.signal_name, str(path) if path is not None else None, how)

    def train_step(self, rows: list[dict[str, Any]], step: int) -> dict[str, Any]:
        c, t = self.c, self.timer
        start = time.perf_counter()
        with t.phase("step"):
            cache = getattr(c.engine, "cache", None)  # vLLM's prefix-cache counters
            cached_before = (cache.prompt_tokens, cache.cached_tokens) if cache is not None else (0, 0)
            with t.phase("gen"), c.weight_sync:  # enter: the engine gets the actor's current weights
                # None off the group's leader; dynamic sampling may roll out (and score) several rounds here.
                local, generated, group_rows, sampling = self.collector.collect(rows, step)
            if local is not None:  # this rank leads a rollout group: what failed, said once per step
                self.report_rollout(generated, step, "train")
            version = c.weight_sync.version.value  # the weights these rows were sampled with
            sync = c.weight_sync.metrics()
            if cache is not None:
                prompt_tokens = cache.prompt_tokens - cached_before[0]
                hits = cache.cached_tokens - cached_before[1]
                sync["rollout/prefix_cache_hit_rate"] = hits / prompt_tokens if prompt_tokens else 0.0
            if local is not None:  # a timing (so under timing_s/): this rank's rollout group, rank 0's when logged
                sync["timing_s/rollout_event_loop_max_stall"] = float(local.info.get("rollout/event_loop_max_stall_s", 0.0))
            with t.phase("distribute"):  # includes waiting for the slowest group's rollout
                batch, rollout_stats, num_groups, plan = self.distribute(local, generated, group_rows, step)
            with t.phase("old_log_prob"):
                batch = c.actor.compute_log_prob(batch, calculate_entropy=True)
                sync.update(c.actor.routing_metrics())  # rollout/routing_agreement (actor.moe.routing_replay)
            if c.ref is not None:
                with t.phase("ref"):
                    batch = c.ref.compute_ref_log_prob(batch)
            if c.critic is not None:
                with t.phase("values"):
                    c.critic.reload()  # no-op unless critic.*_offload moved it away after the last update
                    batch = c.critic.compute_values(batch)
            with t.phase("adv"):
                batch, adv_metrics = exp.compute_experience(
                    batch, self.cfg.algorithm, c.kl_ctrl, reduce=sum_over(self.dp_group), num_groups=num_groups
                )
            update_metrics: dict[str, float] = {}
            if self.dumps and step % self.cfg.trainer.rollout_data_freq == 0:
                with t.phase("dump"):
                    update_metrics.update(self.dump_train(local, batch, plan, step, version))
            if c.critic is not None:
                with t.phase("update_critic"):
                    update_metrics.update(prefix("critic/", c.critic.update_critic(batch)))
                    c.critic.offload()  # what critic.*_offload names stays off the device until the next step
            if c.critic is None or step > self.cfg.critic.warmup_steps:
                with t.phase("update_actor"):
                    actor_batch, loss_metrics = self.actor_batch(batch)
                    update_metrics.update(loss_metrics)
                    update_metrics.update(prefix("actor/", c.actor.update_policy(actor_batch)))
                c.weight_sync.version.bump()  # the engine must resync before the next rollout
        extra = {**adv_metrics, **update_metrics, **sync, **sampling}
        return self.step_metrics(batch, rollout_stats, extra, time.perf_counter() - start)

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
        )
        tensors = {"response_mask": corr.mask}
        if cfg.rollout_is is not None:
            tensors["rollout_is_weights"] = corr.weights
        return batch.update(tensors), corr.metrics

    @property
    def dp_group(self) -> Any:
        """The group that sums over DP replicas (one rank per replica); None with one replica."""
        return self.c.layout.dp_group() if self.c.layout.data_parallel_size > 1 else None

    def distribute(
        self, local: Batch | None, generated: list[Batch], group_rows: list[int], step: int
    ) -> tuple[Batch, Stats, int, StepPlan]:
        """This replica's rows of the step (tensors only), the rollout statistics of the whole step (over every
        ``generated`` row, filtered groups included), the step's count of prompt-group ids and the plan.
        ``group_rows``: the rows each rollout group trains. The leaders' per-row objects never leave them."""
        c, sizes = self.c, self.c.sizes
        if local is not None:
            local = tag_groups(local, sum(group_rows[: c.placement.group_index]))
        stats = exp.rollout_stats(generated).reduce(world=True)
        shapes = gather_shapes(local, c.placement, group_rows)
        minis = [sizes.actor.mini_batch_sequences] + ([sizes.critic.mini_batch_sequences] if sizes.critic else [])
        actor = self.cfg.actor
        plan = plan_step(
            shapes, c.layout.data_parallel_size, mini_batch_sizes=minis,
            seed=actor.seed + step * SEED_STRIDE if actor.shuffle else None,
        )
        batch = exchange_rows(local, plan, c.layout, self.pad_id, c.routing_shape)
        return batch, stats, sizes.sequences_per_step, plan

    def dump_train(self, local: Batch | None, batch: Batch, plan: StepPlan, step: int, version: int) -> dict[str, float]:
        """Bring the trainer's per-token values of each leader's rows back to it and queue its dump (collective)."""
        fields = [f for f in TRAINER_FIELDS if f in batch]
        returned = return_rows(batch, plan, self.c.layout, fields, len(local) if local is not None else None)
        if local is None or self.dump_writer is None:
            return {}
        self._dump([local], "train", step, version, returned)
        return {"dump/dropped_rows": float(self.dump_writer.dropped_rows), "dump/failed": float(self.dump_writer.failed)}

    def _dump(self, batches: list[Batch], split: str, step: int, version: int, returned: Any = None) -> None:
        """Queue a leader's dump. Best effort: only leaders run this, so an error here must not leave the
        other ranks waiting in the next collective; it is logged and counted (``dump/failed``)."""
        t = self.cfg.trainer
        assert self.dump_writer is not None and t.rollout_data_dir is not None
        group = self.c.placement.group_index
        try:
            dump_rows(
                self.dump_writer, t.rollout_data_dir, batches, split=split, step=step,
                group=group, weight_version=version, tokenizer=self.c.tokenizer,
                fraction=t.rollout_data_fraction if split == "train" else 1.0, max_rows=t.rollout_data_max_rows,
                seed=(self.cfg.seed + step) * 1009 + group, trainer_fields=returned,
            )
        except Exception as exc:  # noqa: BLE001 -- a diagnostic must not stop (or hang) training
            self.dump_writer.failed += 1
            logger.warning("trajectory dump of %s step %d (rollout group %d) failed: %r", split, step, group, exc)

    def step_metrics(self, batch: Batch, rollout_stats: Stats, extra: dict[str, float], seconds: float) -> dict[str, Any]:
        """The step's metrics on every rank: rollout statistics (reduced over the world), this replica's
        rows' statistics reduced over DP, the updates' (already global) and timings."""
        m: dict[str, Any] = {}
        m.update(exp.rollout_metrics(rollout_stats))
        m.update(exp.rollout_vs_train_metrics(batch, self.dp_group))
        m.update(compute_data_metrics(batch, self.cfg.data.max_response_length, self.dp_group))
        m.update(extra)
        m.update(self.timer.pop())
        m.update(self.gpu.pop())
        m.update(self.sft_summary)  # once: with the first RL step after the warm start
        self.sft_summary = {}
        tokens = Stats().add("tokens", batch["attention_mask"].sum().reshape(1)).reduce(self.dp_group).total("tokens")
        m.update(throughput_metrics(int(tokens), seconds, self.c.layout.world_size))
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
                **self.gpu.pop(),
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
        """Greedy single-sample rollout of each group's share of the validation prompts; mean reward/accuracy.

        ``data.val_batch_size`` (prompts, over all rollout groups) bounds one rollout call; null
        rolls out each group's whole share at once.
        """
        c = self.c
        if not c.val_rows:
            return {}
        with self.timer.phase("validate"):
            rows = c.placement.strided_rows(c.val_rows)
            val_cfg = dataclasses.replace(self.cfg.rollout, n=1, temperature=0.0, seed=self.cfg.seed)
            size = self.cfg.data.val_batch_size
            chunk = max(1, -(-size // c.placement.num_groups)) if size is not None else max(1, len(rows))
            parts = [rows[i : i + chunk] for i in range(0, len(rows), chunk)]
            batches = []
            with c.weight_sync:
                if c.placement.is_leader:
                    batches = [self.collector.rollout(part, val_cfg) for part in parts]
            scored = [
                exp.score_rollout(b, c.reward_fn, c.tokenizer, [r.get("extra_info") or {} for r in part])
                for b, part in zip(batches, parts)
            ]  # none off the leaders
            if scored:
                self.report_rollout(scored, self.state.step, "val")
            if self.dump_writer is not None and scored:
                self._dump(scored, "val", self.state.step, c.weight_sync.version.value)
            m = exp.rollout_metrics(exp.rollout_stats(scored).reduce(world=True))
            out = {f"val/{k}": m[k] for k in ("reward/mean", "reward/accuracy", "rollout/tool_calls_per_sample")}
        out["timing_s/validate"] = self.timer.pop().get("timing_s/validate", 0.0)
        out.update(self.gpu.pop())  # the validation's own device readings (the step's were popped already)
        return out

    # ----------------------------------------------------------------------------------- checkpoints
    def save(self, step: int) -> Any:
        state = {
            "loop": dataclasses.asdict(self.state),
            "dataloader": self.c.train_loader.state_dict(),
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
        self.c.train_loader.load_state_dict(s["dataloader"])
        self.c.kl_ctrl.value = s["kl_coef"]
        self.c.weight_sync.version.value = int(s.get("weight_version", self.state.step + int(self.state.sft_done)))
        self.tracker.continue_after(self.state.step)  # the steps after it are re-run: each is logged once
        self.timer.pop()
        if self.c.layout.rank == 0:
            print(f"resumed from {path} at step {self.state.step}", flush=True)


def prefix(p: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{p}{k}": v for k, v in metrics.items()}
