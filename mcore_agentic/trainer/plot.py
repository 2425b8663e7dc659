"""End-of-run curves (reward, response length, validation reward) as PNG, read from metrics.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never open a window (headless nodes)
import matplotlib.pyplot as plt  # noqa: E402

from mcore_agentic.trainer.metrics import RESPONSE_LENGTH_KEY, REWARD_KEY, VAL_REWARD_PREFIX  # noqa: E402

CURVES = {REWARD_KEY: "reward_curve.png", RESPONSE_LENGTH_KEY: "response_length_curve.png"}


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics.jsonl; a torn last line (the run was killed mid-write) is skipped.

    When a resumed run re-logged steps, the later record of a step wins.
    """
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_curves(metrics_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Save one PNG per curve that has data; return their paths.

    Draws ``critic/score/mean`` (with every ``val/...score...`` or ``val/...reward...`` series on
    the same axes) and ``response_length/mean`` against the step.
    """
    records = read_metrics(metrics_path)
    out = Path(out_dir) if out_dir is not None else Path(metrics_path).parent
    out.mkdir(parents=True, exist_ok=True)
    val_keys = sorted(
        {k for r in records for k in r if k.startswith(VAL_REWARD_PREFIX) and ("score" in k or "reward" in k)}
    )
    written = []
    for key, filename in CURVES.items():
        xs, ys = _series(records, key)
        extra = [(k, *_series(records, k)) for k in val_keys] if key == REWARD_KEY else []
        if not xs and not any(e[1] for e in extra):
            continue
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
        for name, vx, vy in extra:
            if vx:
                ax.plot(vx, vy, marker="o", linestyle="--", label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(key.split("/")[-2] if "/" in key else key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
