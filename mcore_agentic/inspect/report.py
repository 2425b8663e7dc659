"""The token-level trajectory report: one self-contained HTML file built from a dump directory.

No network at view time: the page carries its data (JSON), style and script inline. Per step
and split, a summary table (rows, reward, accuracy, tool calls and errors, finish reasons,
response length, the largest rollout/trainer log-prob gap). Per trajectory: a header (reward
and its parts, finish reason, turns, weight version, latency), the prompt (collapsed), then the
response token by token — ``tok policy`` for tokens the policy sampled (loss mask 1), ``tok env``
for tokens the environment added (tool results, templates: mask 0), ``gap`` where
|rollout log-prob − trainer log-prob| exceeds the threshold — and the tool calls with their
arguments, results, errors and latency. Hovering a token shows its id, log-probs, gap and
advantage. Filters: split, step, reward range, finish reason, tool errors only; the URL
fragment (``#finish=length&errors=1``) sets them at load.

The script renders the token spans from the embedded data, so what a browser shows is what
the tests read back from a real headless Chromium's DOM.
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from mcore_agentic.feed.rollout_dump import read_dump

__all__ = ["build_report", "step_summary", "write_report"]


def _r(x: float | None, digits: int = 4) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


def _gaps(row: dict[str, Any]) -> list[float | None]:
    """|rollout − trainer| per response token where the policy sampled it and both exist, else None."""
    old = row.get("old_log_probs")
    if old is None:
        return [None] * len(row["response_ids"])
    return [abs(a - b) if m else None for a, b, m in zip(row["rollout_log_probs"], old, row["response_mask"])]


def step_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (split, step): counts and means over its rows."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["split"], r["step"]), []).append(r)
    out = []
    for (split, step), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "train", kv[0][1])):
        gaps = [g for r in rs for g in _gaps(r) if g is not None]
        finish = Counter(r["finish_reason"] for r in rs)
        out.append(
            {
                "split": split,
                "step": step,
                "rows": len(rs),
                "reward": sum(r["reward"] for r in rs) / len(rs),
                "acc": sum(r["acc"] for r in rs) / len(rs),
                "tool_calls": sum(len(r["tool_calls"]) for r in rs) / len(rs),
                "tool_errors": sum(c["error"] for r in rs for c in r["tool_calls"]),
                "response_tokens": sum(len(r["response_ids"]) for r in rs) / len(rs),
                "finish": ", ".join(f"{k} {v}" for k, v in sorted(finish.items())),
                "max_gap": max(gaps) if gaps else None,
            }
        )
    return out


def _trajectory(r: dict[str, Any]) -> dict[str, Any]:
    """The compact JSON the page's script renders (short keys keep big reports small)."""
    tlp = r.get("old_log_probs")
    adv = r.get("advantages")
    return {
        "step": r["step"], "split": r["split"], "group": r["group"], "row": r["row"],
        "reward": _r(r["reward"]), "acc": _r(r["acc"]),
        "parts": {k: _r(r[f"reward_{k}"]) for k in ("rule", "tool", "interaction", "kl_penalty")},
        "finish": r["finish_reason"], "state": r["state"], "error": r["error"], "turns": r["num_turns"],
        "wv": r["weight_version"], "latency": _r(r["latency_seconds"], 3), "gt": r["ground_truth"],
        "prompt": r["prompt_text"], "promptLen": len(r["prompt_ids"]),
        "toks": r["response_tokens"], "ids": r["response_ids"], "mask": r["response_mask"],
        "rlp": [_r(x) for x in r["rollout_log_probs"]],
        "tlp": None if tlp is None else [_r(x) for x in tlp],
        # from unrounded log-probs (fp32 gaps are tiny); a non-finite gap shows as none rather than breaking the JSON
        "gap": [None if g is None or not math.isfinite(g) else float(f"{g:.3g}") for g in _gaps(r)],
        "adv": None if adv is None else [_r(x) for x in adv],
        "calls": [
            {"turn": c["turn"], "name": c["name"], "args": c["arguments"], "result": c["result"],
             "error": c["error"], "s": _r(c["seconds"], 4)}
            for c in r["tool_calls"]
        ],
        "toolErrors": sum(bool(c["error"]) for c in r["tool_calls"]),
        # an agent program's episode: its samples and forks (dumps before issue 32 have no such columns)
        "agentSamples": r.get("agent_samples"),
        "agentForks": r.get("agent_forks"),
        # each assistant turn's last sampled token and its own reward (dumps before issue 33 have neither)
        "turnEnds": r.get("turn_ends") or [],
        "turnRewards": [_r(x) for x in r.get("turn_rewards") or []],
    }


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _summary_html(summary: Iterable[dict[str, Any]]) -> str:
    head = ("split", "step", "rows", "reward", "accuracy", "tool calls / row", "tool errors", "response tokens",
            "finish reasons", "max |Δ log-prob|")
    lines = ["<table id='summary'><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for s in summary:
        cells = (s["split"], s["step"], s["rows"], _fmt(s["reward"]), _fmt(s["acc"]), _fmt(s["tool_calls"], 2),
                 s["tool_errors"], _fmt(s["response_tokens"], 1), s["finish"], _fmt(s["max_gap"], 4))
        lines.append(
            f"<tr data-split='{html.escape(s['split'])}' data-step='{s['step']}'>"
            + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
        )
    lines.append("</tbody></table>")
    return "\n".join(lines)


def build_report(
    table: pa.Table, *, source: str = "", gap_threshold: float = 0.5, max_rows_per_step: int | None = 64
) -> str:
    """The report's HTML for a dump ``table`` (:func:`~mcore_agentic.feed.rollout_dump.read_dump`).

    ``max_rows_per_step``: trajectories shown per (split, step), the first by group and row (the
    summary always counts all); None shows all.
    """
    rows = table.to_pylist()
    summary = step_summary(rows)
    shown: list[dict[str, Any]] = []
    seen: Counter[tuple[str, int]] = Counter()
    for r in rows:
        key = (r["split"], r["step"])
        if max_rows_per_step is None or seen[key] < max_rows_per_step:
            shown.append(_trajectory(r))
            seen[key] += 1
    finishes = sorted({r["finish_reason"] for r in rows})
    steps = sorted({r["step"] for r in rows})
    data = json.dumps({"trajectories": shown, "gapThreshold": gap_threshold}, separators=(",", ":"), allow_nan=False)
    # Model- and tool-written text must not reach the HTML parser as markup: with <, > and & escaped nothing in
    # the data can close the script element or enter its escaped states (``<!--``); JSON.parse restores them.
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    options = lambda values: "".join(f"<option value='{html.escape(str(v))}'>{html.escape(str(v))}</option>" for v in values)  # noqa: E731
    return (
        _TEMPLATE.replace("__TITLE__", html.escape(f"Trajectories: {source}" if source else "Trajectories"))
        .replace("__SOURCE__", html.escape(source))
        .replace("__COUNTS__", f"{len(rows)} trajectories in {len(summary)} step dumps; {len(shown)} shown")
        .replace("__GAP__", f"{gap_threshold:g}")
        .replace("__SUMMARY__", _summary_html(summary))
        .replace("__STEP_OPTIONS__", options(steps))
        .replace("__FINISH_OPTIONS__", options(finishes))
        .replace("__DATA__", data)
    )


def write_report(
    dump_dir: str | Path, out: str | Path, *, gap_threshold: float = 0.5, max_rows_per_step: int | None = 64
) -> Path:
    """Read the dumps under ``dump_dir``, write the report to ``out``; returns ``out``."""
    text = build_report(
        read_dump(dump_dir), source=str(dump_dir), gap_threshold=gap_threshold, max_rows_per_step=max_rows_per_step
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0 1.5em 3em;color:#1d2330;background:#fafbfc}
h1{font-size:20px;margin:.8em 0 .2em} .muted{color:#66708a}
table{border-collapse:collapse;margin:.6em 0;background:#fff} th,td{border:1px solid #d8dce6;padding:3px 8px;text-align:right}
th{background:#eef1f6;font-weight:600} td:first-child,td:nth-child(9){text-align:left}
#filters{position:sticky;top:0;background:#fafbfc;padding:.5em 0;border-bottom:1px solid #d8dce6;z-index:2}
#filters label{margin-right:1em} #filters input[type=number]{width:5em}
.legend span{margin-right:1.2em}
.traj{background:#fff;border:1px solid #d8dce6;border-radius:6px;margin:.8em 0;padding:.5em .8em}
.traj.hidden{display:none} .traj .head{font-weight:600} .traj .head .bad{color:#b3261e}
.traj details{margin:.3em 0} .traj pre{white-space:pre-wrap;font:12px/1.4 ui-monospace,Menlo,Consolas,monospace;
background:#f4f5f8;padding:.4em;margin:0;max-height:14em;overflow:auto}
.tokens{white-space:pre-wrap;font:13px/1.7 ui-monospace,Menlo,Consolas,monospace;word-break:break-all}
.tok{border-radius:2px;padding:0 .5px;cursor:default;box-shadow:inset -1px 0 #fff}
.tok.policy{background:#d9ecff;color:#0b3d91}
.tok.env{background:#eeeeee;color:#555}
.tok.gap{outline:2px solid #e8590c;background:#ffe3cc}
.tok.turnend{border-right:3px solid #2b8a3e}
.tok:hover{filter:brightness(.85)}
.calls td{text-align:left;vertical-align:top;font:12px ui-monospace,Menlo,Consolas,monospace;max-width:40em;white-space:pre-wrap}
.calls tr.err td{color:#b3261e}
#tip{position:fixed;right:1em;bottom:1em;background:#1d2330;color:#fff;padding:.5em .8em;border-radius:6px;
font:12px/1.5 ui-monospace,Menlo,Consolas,monospace;white-space:pre;display:none;z-index:3}
</style></head><body>
<h1>__TITLE__</h1>
<div class="muted">__COUNTS__. Made by <code>python -m mcore_agentic.inspect</code>; no network needed.</div>
<div class="legend"><span class="tok policy">policy-sampled (loss mask 1)</span>
<span class="tok env">environment-added (mask 0: prompt template, tool results)</span>
<span class="tok policy gap">|rollout − trainer log-prob| &gt; __GAP__</span></div>
<h2>Per step</h2>
__SUMMARY__
<div id="filters">
<label>split <select id="f-split"><option value="">all</option><option>train</option><option>val</option></select></label>
<label>step <select id="f-step"><option value="">all</option>__STEP_OPTIONS__</select></label>
<label>reward from <input id="f-rmin" type="number" step="0.1"> to <input id="f-rmax" type="number" step="0.1"></label>
<label>finish <select id="f-finish"><option value="">all</option>__FINISH_OPTIONS__</select></label>
<label><input id="f-errors" type="checkbox"> tool errors only</label>
<span id="f-count" class="muted"></span>
</div>
<div id="trajectories"></div>
<div id="tip"></div>
<script type="application/json" id="dump-data">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("dump-data").textContent);
const fmt = (x, d = 3) => (x === null || x === undefined) ? "–" : Number(x).toFixed(d);
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function renderTrajectory(t, index) {
  const box = el("div", {class: "traj", id: "traj-" + index, "data-split": t.split, "data-step": t.step,
    "data-reward": t.reward, "data-finish": t.finish, "data-tool-errors": t.toolErrors});
  const parts = Object.entries(t.parts).filter(([, v]) => v).map(([k, v]) => k + " " + fmt(v)).join(", ");
  const head = el("div", {class: "head"});
  head.append(`${t.split} step ${t.step} · group ${t.group} row ${t.row} · reward ${fmt(t.reward)}` +
    (parts ? ` (${parts})` : "") + ` · acc ${fmt(t.acc, 0)} · finish ${t.finish} · ${t.turns} turns · ` +
    `weights v${t.wv} · ${fmt(t.latency, 2)} s`);
  if (t.agentSamples) head.append(el("span", {class: t.agentSamples > 1 ? "bad" : "muted"},
    ` · agent episode: ${t.agentSamples} sample(s), forks ${t.agentForks}`));
  if (t.state === "failed") head.append(el("span", {class: "bad"}, ` · FAILED: ${t.error}`));
  if (t.gt !== null) head.append(el("span", {class: "muted"}, ` · ground truth ${t.gt}`));
  box.append(head);
  const prompt = el("details");
  prompt.append(el("summary", {}, `prompt (${t.promptLen} tokens, environment)`), el("pre", {}, t.prompt));
  box.append(prompt);
  const tokens = el("div", {class: "tokens"});
  for (let i = 0; i < t.ids.length; i++) {
    const gap = t.gap[i];
    let cls = "tok " + (t.mask[i] ? "policy" : "env");
    if (gap !== null && gap > DATA.gapThreshold) cls += " gap";
    const turn = t.turnEnds.indexOf(i);
    if (turn >= 0) cls += " turnend";
    const s = el("span", {class: cls, "data-i": i}, t.toks[i]);
    s.title = `id ${t.ids[i]} · ${t.mask[i] ? "policy" : "environment"}` +
      (t.mask[i] ? ` · rollout lp ${fmt(t.rlp[i], 4)} · trainer lp ${fmt(t.tlp ? t.tlp[i] : null, 4)}` +
       ` · |Δ| ${gap === null ? "–" : gap.toPrecision(3)}` : "") + ` · advantage ${fmt(t.adv ? t.adv[i] : null, 4)}` +
      (turn >= 0 ? ` · end of turn ${turn + 1}, its reward ${fmt(t.turnRewards[turn], 3)}` : "");
    tokens.append(s);
  }
  box.append(tokens);
  if (t.calls.length) {
    const table = el("table", {class: "calls"});
    table.append(el("tr", {}, ""));
    table.firstChild.append(el("th", {}, "turn"), el("th", {}, "tool"), el("th", {}, "arguments"),
      el("th", {}, "result"), el("th", {}, "seconds"));
    for (const c of t.calls) {
      const tr = el("tr", {class: c.error ? "call err" : "call"});
      tr.append(el("td", {}, c.turn), el("td", {}, c.name === null ? "?" : c.name), el("td", {}, c.args),
        el("td", {}, (c.error ? "ERROR " : "") + c.result), el("td", {}, fmt(c.s, 4)));
      table.append(tr);
    }
    box.append(table);
  }
  return box;
}
const root = document.getElementById("trajectories");
DATA.trajectories.forEach((t, i) => root.append(renderTrajectory(t, i)));
const tip = document.getElementById("tip");
root.addEventListener("mouseover", e => {
  if (!e.target.classList.contains("tok")) return;
  tip.textContent = JSON.stringify(e.target.textContent) + "\\n" + e.target.title.split(" · ").join("\\n");
  tip.style.display = "block";
});
root.addEventListener("mouseout", e => { if (e.target.classList.contains("tok")) tip.style.display = "none"; });
const F = id => document.getElementById(id);
function applyFilters() {
  const split = F("f-split").value, step = F("f-step").value, finish = F("f-finish").value;
  const rmin = F("f-rmin").value === "" ? -Infinity : Number(F("f-rmin").value);
  const rmax = F("f-rmax").value === "" ? Infinity : Number(F("f-rmax").value);
  const errors = F("f-errors").checked;
  let shown = 0;
  for (const box of root.children) {
    const d = box.dataset, r = Number(d.reward);
    const ok = (!split || d.split === split) && (!step || d.step === step) && (!finish || d.finish === finish) &&
      r >= rmin && r <= rmax && (!errors || Number(d.toolErrors) > 0);
    box.classList.toggle("hidden", !ok);
    shown += ok;
  }
  F("f-count").textContent = `${shown} of ${root.children.length} trajectories`;
  document.body.dataset.shown = shown;
}
const params = new URLSearchParams(location.hash.slice(1));
const keys = {split: "f-split", step: "f-step", finish: "f-finish", rmin: "f-rmin", rmax: "f-rmax"};
for (const [k, id] of Object.entries(keys)) if (params.has(k)) F(id).value = params.get(k);
if (params.get("errors") === "1") F("f-errors").checked = true;
for (const id of ["f-split", "f-step", "f-finish", "f-rmin", "f-rmax", "f-errors"]) F(id).addEventListener("input", applyFilters);
applyFilters();
document.body.dataset.ready = "1";
</script></body></html>
"""
