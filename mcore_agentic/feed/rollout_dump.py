"""Trajectory dumps (``trainer.rollout_data_dir``): every dumped row of a step, token by token, as parquet.

Each rollout leader writes its own rows (their Python objects never leave it, see
:mod:`.distribute`) to ``<dir>/<split>/step_<k>-group_<g>.parquet``: ``train`` every
``rollout_data_freq``-th RL step, ``val`` at every validation. A row holds the conversation
(messages as JSON), prompt and response token ids, the response's per-token strings, loss
mask, rollout (engine) and trainer log-probs, advantages, reference log-probs and values when
the run has them, the reward and its parts, every tool call (arguments, result, error,
latency), the finish reason, the weight version it was sampled with and its timings. The
trainer-side tensors live on the DP replica that trained the row; :func:`return_rows`
brings them back to the leader, on dump steps only.

Writing happens on one background thread per process (:class:`DumpWriter`) behind a queue
of ``rollout_data_queue_size`` tables. When the queue is full (the disk is slower than the
steps), the step waits at most ``rollout_data_wait_s`` seconds for a slot, then drops that
table: it logs a warning and counts the rows in ``dump/dropped_rows``. Files appear
atomically (written to ``*.tmp``, then renamed); :meth:`DumpWriter.close` drains the queue,
so a run that ends or is stopped by a signal loses nothing it queued.

:func:`read_dump` loads a dump directory back as one table (the inspector and tests use it).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.feed.fields import RETURNED

logger = logging.getLogger(__name__)

__all__ = [
    "DumpWriter", "SCHEMA", "TRAINER_FIELDS", "dump_rows", "read_dump", "select_rows", "trajectory_records",
    "trajectory_table",
]

TRAINER_FIELDS = RETURNED
"""Per-response-token tensors computed on the training replica that a dump brings back to the leader (the seam's
table of fields, :mod:`.fields`)."""

_FLOATS = pa.list_(pa.float32())
TOOL_CALL = pa.struct(
    [
        ("turn", pa.int32()),
        ("name", pa.string()),
        ("arguments", pa.string()),
        ("result", pa.string()),
        ("error", pa.bool_()),
        ("seconds", pa.float64()),
        ("error_type", pa.string()),
        ("traceback", pa.string()),
    ]
)
SCHEMA = pa.schema(
    [
        ("step", pa.int32()),
        ("split", pa.string()),
        ("group", pa.int32()),
        ("row", pa.int32()),
        ("uid", pa.string()),
        ("request_id", pa.string()),
        ("weight_version", pa.int64()),
        ("data_source", pa.string()),
        ("ground_truth", pa.string()),
        ("messages", pa.string()),
        ("prompt_text", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_tokens", pa.list_(pa.string())),
        ("response_mask", pa.list_(pa.int8())),
        ("rollout_log_probs", _FLOATS),
        ("old_log_probs", _FLOATS),
        ("advantages", _FLOATS),
        ("ref_log_probs", _FLOATS),
        ("values", _FLOATS),
        ("reward", pa.float32()),
        ("reward_rule", pa.float32()),
        ("reward_tool", pa.float32()),
        ("reward_interaction", pa.float32()),
        ("reward_kl_penalty", pa.float32()),
        ("reward_overlong", pa.float32()),
        ("acc", pa.float32()),
        ("finish_reason", pa.string()),
        ("state", pa.string()),
        ("error", pa.string()),
        ("error_traceback", pa.string()),
        ("num_turns", pa.int32()),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("generate_seconds", pa.float64()),
        ("tool_seconds", pa.float64()),
        ("latency_seconds", pa.float64()),
        ("sanity_check_mismatch", pa.bool_()),
        ("agent_samples", pa.int32()),
        ("agent_forks", pa.string()),
        ("episode_id", pa.string()),
        ("episode_sample", pa.int32()),
        ("episode_samples", pa.int32()),
        ("turn_ends", pa.list_(pa.int32())),
        ("turn_rewards", pa.list_(pa.float32())),
    ]
)
"""One row per trajectory. Trainer-side columns (``old_log_probs`` ... ``values``) are null in ``val``
dumps and where the run has no such model; all per-token lists run over the response. ``turn_ends`` and
``turn_rewards``: per assistant turn, the response index of its last sampled token (-1: none) and its own
reward (its tools' step rewards, the interaction's score of the reply to it, an agent program's reward posted for
it), whether or not ``algorithm.turn_rewards`` placed it there. ``episode_id``, ``episode_sample`` and
``episode_samples``: the episode a row is a sample of (an agent episode whose session forked trains each sample)."""


def select_rows(n: int, *, fraction: float, max_rows: int | None, seed: int) -> list[int]:
    """The local rows to dump: a ``seed``-ed sample of ``fraction`` of ``n`` (at least one), at most ``max_rows``."""
    k = n if fraction >= 1.0 else max(1, round(n * fraction))
    if max_rows is not None:
        k = min(k, max_rows)
    if k >= n:
        return list(range(n))
    return sorted(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist())


class _TokenText:
    """Per-token strings, decoded once per id (a byte-level BPE piece of a multi-byte character decodes to U+FFFD)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            text = self.cache.get(i)
            if text is None:
                text = self.cache[i] = self.tokenizer.decode([i], skip_special_tokens=False)
            out.append(text)
        return out


def _floats(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else t.float().tolist()


def trajectory_table(batch: Batch, rows: Sequence[int], **kwargs: Any) -> pa.Table:
    """:func:`trajectory_records` as a pyarrow table of :data:`SCHEMA`."""
    return pa.Table.from_pylist(trajectory_records(batch, rows, **kwargs), schema=SCHEMA)


def trajectory_records(
    batch: Batch,
    rows: Sequence[int],
    *,
    step: int,
    split: str,
    group: int,
    weight_version: int,
    tokenizer: Any,
    trainer_fields: dict[str, list[torch.Tensor]] | None = None,
) -> list[dict[str, Any]]:
    """The dump records of ``rows`` (local indices) of a scored rollout ``batch`` held by a leader.

    ``trainer_fields``: per local row, the response-length tensors of :data:`TRAINER_FIELDS` that
    :func:`return_rows` brought back (None for validation rollouts).
    """
    text = _TokenText(tokenizer)
    width = batch["prompts"].shape[1]
    attn = batch["attention_mask"]
    fields = trainer_fields or {}
    records = []
    for i in rows:
        p = int(attn[i, :width].sum())
        r = int(attn[i, width:].sum())
        prompt_ids = batch["prompts"][i, width - p :].tolist()
        response_ids = batch["responses"][i, :r].tolist()
        rm = batch["request_metrics"][i] or {}
        field = {k: v[i] for k, v in fields.items()}
        kl_penalty = 0.0
        if "token_level_scores" in field and "token_level_rewards" in field:
            kl_penalty = float((field["token_level_scores"] - field["token_level_rewards"]).sum())
        records.append(
            {
                "step": step,
                "split": split,
                "group": group,
                "row": i,
                "uid": str(batch["uid"][i]),
                "request_id": str(rm.get("request_id", "")),
                "weight_version": weight_version,
                "data_source": str(batch["data_source"][i]),
                "ground_truth": None if batch["ground_truth"][i] is None else str(batch["ground_truth"][i]),
                "messages": json.dumps(batch["messages"][i], default=str),
                "prompt_text": tokenizer.decode(prompt_ids, skip_special_tokens=False),
                "prompt_ids": prompt_ids,
                "response_ids": response_ids,
                "response_tokens": text(response_ids),
                "response_mask": batch["response_mask"][i, :r].tolist(),
                "rollout_log_probs": batch["rollout_log_probs"][i, :r].tolist(),
                "old_log_probs": _floats(field.get("old_log_probs")),
                "advantages": _floats(field.get("advantages")),
                "ref_log_probs": _floats(field.get("ref_log_probs")),
                "values": _floats(field.get("values")),
                "reward": float(batch["seq_scores"][i]),
                "reward_rule": float(batch["rule_score"][i]),
                "reward_tool": float(batch["tool_rewards"][i] or 0.0),
                "reward_interaction": float(rm.get("interaction_final_score") or 0.0),
                "reward_kl_penalty": kl_penalty,
                "reward_overlong": float((batch.meta.get("overlong_penalty") or [0.0] * len(batch))[i]),
                "acc": float(batch["acc"][i]),
                "finish_reason": str(batch["finish_reason"][i]),
                "state": str(rm.get("state", "")),
                "error": rm.get("error"),
                "error_traceback": rm.get("error_traceback"),
                "num_turns": int(batch["num_turns"][i]),
                "tool_calls": list(batch["tool_log"][i]) if "tool_log" in batch.meta else [],
                "generate_seconds": float(rm.get("generate_seconds", 0.0)),
                "tool_seconds": float(rm.get("tool_seconds", 0.0)),
                "latency_seconds": float(rm.get("latency_seconds", 0.0)),
                "sanity_check_mismatch": bool(rm.get("sanity_check_mismatch", 0)),
                # an agent program's episode (rollout.agent): its samples and forks by reason; null otherwise
                "agent_samples": int(rm["agent_samples"]) if rm.get("agent_samples") else None,
                "agent_forks": json.dumps(rm.get("agent_fork_reasons") or {}) if rm.get("agent_samples") else None,
                # the episode a row is a sample of (an agent episode that forked trains several samples)
                "episode_id": str((batch.meta.get("episode_id") or [None] * len(batch))[i] or batch["uid"][i]),
                "episode_sample": int((batch.meta.get("episode_sample") or [0] * len(batch))[i]),
                "episode_samples": int((batch.meta.get("episode_samples") or [1] * len(batch))[i]),
                "turn_ends": list((batch.meta.get("turn_ends") or [[]] * len(batch))[i] or []),
                "turn_rewards": _turn_rewards(batch, i),
            }
        )
    return records


def _turn_rewards(batch: Batch, i: int) -> list[float]:
    """Row ``i``'s reward per assistant turn from the rollout (tool step rewards, interaction turn scores, an agent
    program's per-turn posts), one number per entry of ``turn_ends``."""
    turns = len((batch.meta.get("turn_ends") or [[]] * len(batch))[i] or [])
    out = [0.0] * turns
    for key in ("turn_tool_rewards", "turn_interaction_scores", "turn_source_rewards"):
        for k, value in enumerate(((batch.meta.get(key) or [[]] * len(batch))[i] or [])[:turns]):
            out[k] += float(value)
    return out


def dump_path(root: str | os.PathLike, split: str, step: int, group: int) -> Path:
    return Path(root) / split / f"step_{step:06d}-group_{group:03d}.parquet"


class DumpWriter:
    """Writes tables on one background thread; a bounded queue keeps a slow disk from stalling the steps."""

    def __init__(self, *, queue_size: int = 4, wait_s: float = 10.0):
        self.queue: queue.Queue[tuple[Path, pa.Table] | None] = queue.Queue(maxsize=queue_size)
        self.wait_s = wait_s
        self.dropped_rows = 0
        self.written_rows = 0
        self.failed = 0
        """Dumps that could not be built or written (each logged as a warning)."""
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._drain, name="rollout-dump", daemon=True)
        self._thread.start()

    def submit(self, path: Path, table: pa.Table) -> bool:
        """Queue ``table`` for ``path``; False (and a warning) when no slot frees within ``wait_s``."""
        if not self._thread.is_alive():
            self.dropped_rows += table.num_rows
            logger.warning("trajectory dump %s dropped (%d rows): the writer thread has stopped", path, table.num_rows)
            return False
        try:
            self.queue.put((path, table), timeout=self.wait_s)
            return True
        except queue.Full:
            self.dropped_rows += table.num_rows
            logger.warning(
                "trajectory dump %s dropped (%d rows): the writer is %.0f s behind; raise "
                "trainer.rollout_data_queue_size or dump less often (trainer.rollout_data_freq)",
                path, table.num_rows, self.wait_s,
            )
            return False

    def _drain(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                path, table = item
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(".parquet.tmp")
                    pq.write_table(table, tmp, compression="zstd")
                    os.replace(tmp, path)
                    self.written_rows += table.num_rows
                except Exception as exc:  # noqa: BLE001 -- a full or vanished disk must not end the run (or this thread)
                    self.failed += 1
                    self.errors.append(f"{path}: {exc!r}")
                    logger.warning("trajectory dump %s not written: %r", path, exc)
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        """Wait until every queued table is on disk."""
        self.queue.join()

    def close(self, timeout_s: float = 300.0) -> None:
        """Write what is queued, then stop the thread; a disk that hangs longer than ``timeout_s`` is left behind
        (a warning says how many dumps were not written)."""
        if not self._thread.is_alive():
            return
        try:
            self.queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("trajectory dump writer still busy after %.0f s: %d queued dumps not written",
                           timeout_s, self.queue.qsize())


def dump_rows(
    writer: DumpWriter,
    root: str | os.PathLike,
    batches: Sequence[Batch],
    *,
    split: str,
    step: int,
    group: int,
    weight_version: int,
    tokenizer: Any,
    fraction: float = 1.0,
    max_rows: int | None = None,
    seed: int = 0,
    trainer_fields: dict[str, list[torch.Tensor]] | None = None,
) -> int:
    """Select, tabulate and queue one leader's rows (``batches``: its scored rollouts of the step, rows numbered
    across them); returns the rows queued (0 if the writer dropped them). ``trainer_fields`` needs one batch."""
    if trainer_fields is not None and len(batches) != 1:
        raise ValueError("trainer_fields belong to a single training batch")
    start = time.perf_counter()
    total = sum(len(b) for b in batches)
    rows = select_rows(total, fraction=fraction, max_rows=max_rows, seed=seed)
    tables, offset = [], 0
    for b in batches:
        mine = [r - offset for r in rows if offset <= r < offset + len(b)]
        table = trajectory_table(
            b, mine, step=step, split=split, group=group, weight_version=weight_version,
            tokenizer=tokenizer, trainer_fields=trainer_fields,
        )
        if offset:
            table = table.set_column(SCHEMA.get_field_index("row"), "row", pa.array([offset + r for r in mine], pa.int32()))
        tables.append(table)
        offset += len(b)
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    queued = writer.submit(dump_path(root, split, step, group), table)
    logger.debug("dump of %d %s rows at step %d built in %.3f s", table.num_rows, split, step, time.perf_counter() - start)
    return table.num_rows if queued else 0


def read_dump(root: str | os.PathLike) -> pa.Table:
    """Every ``*.parquet`` under ``root`` (a dump directory) as one table, sorted by split, step, group and row."""
    files = sorted(Path(root).rglob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no trajectory dumps (*.parquet) under {root}: was trainer.rollout_data_dir set?")
    table = pa.concat_tables([pq.read_table(f, schema=SCHEMA) for f in files])
    return table.sort_by([("split", "ascending"), ("step", "ascending"), ("group", "ascending"), ("row", "ascending")])
