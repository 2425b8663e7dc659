"""The inspector's report in a real browser: headless Chromium renders a report of the default job's dump.

The page's script builds the token spans from the embedded data; Chromium's ``--dump-dom``
gives the DOM after it ran. Every dumped response token must be a span with the class of its
loss mask (``tok policy`` sampled, ``tok env`` environment-added), per trajectory; the summary
table has a line per step dump; a filter given in the URL fragment hides what it should. A
screenshot is saved into the test's tmp dir (docs/inspector.md shows one).
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from mcore_agentic.feed.rollout_dump import read_dump
from mcore_agentic.inspect.report import write_report

CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (Debian: apt-get install chromium; .ci/run does)"),
    pytest.mark.timeout(400),
]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"]


class _Dom(HTMLParser):
    """Token spans per trajectory box, summary rows and the body's data attributes of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.trajs: dict[str, dict] = {}
        self.current: str | None = None
        self.summary_rows = 0
        self.in_summary = False
        self.body: dict[str, str] = {}
        self.images = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "body":
            self.body = a
        if tag == "img":
            self.images += 1
        if tag == "table" and a.get("id") == "summary":
            self.in_summary = True
        if tag == "tr" and self.in_summary and "data-step" in a:
            self.summary_rows += 1
        if tag == "div" and "traj" in classes:
            self.current = a["id"]
            self.trajs[self.current] = {"hidden": "hidden" in classes, "policy": 0, "env": 0, "gap": 0, "calls": 0,
                                        "turnend": 0,
                                        "split": a["data-split"], "step": int(a["data-step"])}
        if tag == "span" and "tok" in classes and self.current is not None:
            t = self.trajs[self.current]
            t["policy" if "policy" in classes else "env"] += 1
            t["gap"] += "gap" in classes
            t["turnend"] += "turnend" in classes
        if tag == "tr" and "call" in classes and self.current is not None:
            self.trajs[self.current]["calls"] += 1

    def handle_endtag(self, tag):
        if tag == "table":
            self.in_summary = False


def _dom(page: Path, fragment: str = "") -> _Dom:
    out = subprocess.run([CHROMIUM, *FLAGS, "--dump-dom", page.as_uri() + fragment],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = _Dom()
    dom.feed(out.stdout)
    assert dom.body.get("data-ready") == "1", "the report's script did not finish"
    return dom


def test_report_renders_every_token_with_its_mask_class(default_job_dump, tmp_path) -> None:
    rows = read_dump(default_job_dump.dump_dir).to_pylist()
    page = write_report(default_job_dump.dump_dir, tmp_path / "report.html", max_rows_per_step=None)
    dom = _dom(page)
    assert len(dom.trajs) == len(rows) and not any(t["hidden"] for t in dom.trajs.values())
    assert dom.summary_rows == len({(r["split"], r["step"]) for r in rows})
    for i, r in enumerate(rows):  # the page keeps the dump's order
        t = dom.trajs[f"traj-{i}"]
        assert (t["split"], t["step"]) == (r["split"], r["step"])
        assert t["policy"] == sum(r["response_mask"]) and t["env"] == len(r["response_mask"]) - sum(r["response_mask"])
        assert t["calls"] == len(r["tool_calls"])
        assert t["turnend"] == sum(e >= 0 for e in r["turn_ends"])  # each assistant turn's end is marked
    assert sum(t["env"] for t in dom.trajs.values()) > 0, "no environment-added token in the whole dump"
    # val rows have no trainer log-probs: nothing can be flagged there
    assert all(t["gap"] == 0 for t in dom.trajs.values() if t["split"] == "val")

    filtered = _dom(page, "#split=val")
    assert int(filtered.body["data-shown"]) == sum(r["split"] == "val" for r in rows)
    assert all(t["hidden"] == (t["split"] != "val") for t in filtered.trajs.values())

    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *FLAGS, "--window-size=1400,1000", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000


def test_gap_threshold_flags_exactly_the_sampled_tokens_above_it(default_job_dump, tmp_path) -> None:
    rows = [r for r in read_dump(default_job_dump.dump_dir).to_pylist() if r["split"] == "train"]
    gaps = sorted(abs(a - b) for r in rows for a, b, m in zip(r["rollout_log_probs"], r["old_log_probs"], r["response_mask"]) if m)
    threshold = gaps[len(gaps) // 2]  # about half the sampled tokens above it
    page = write_report(default_job_dump.dump_dir, tmp_path / "gap.html", gap_threshold=threshold, max_rows_per_step=None)
    dom = _dom(page, "#split=train")
    flagged = sum(t["gap"] for t in dom.trajs.values())
    # the page carries gaps to 3 significant digits: allow the tokens that close to the threshold
    near = sum(abs(g - threshold) <= 5e-3 * threshold for g in gaps)
    assert abs(flagged - sum(g > threshold for g in gaps)) <= near
    assert 0 < flagged < len(gaps)


def test_model_and_tool_text_cannot_break_the_page(default_job_dump, tmp_path) -> None:
    """A trajectory whose tokens and tool result carry markup (``</script>``, ``<!--<script>``, an inline handler)
    and a non-finite log-prob renders as text: the script still runs, every token is a span, no element is injected."""
    import shutil as sh

    import pyarrow as pa
    import pyarrow.parquet as pq

    from mcore_agentic.feed.rollout_dump import SCHEMA

    dump = tmp_path / "dump"
    sh.copytree(default_job_dump.dump_dir, dump)
    row = next(r for r in read_dump(dump).to_pylist() if r["split"] == "train")
    hostile = ["</script>", "<!--<script>", "<img src=x onerror=\"document.body.dataset.pwned=1\">", "&amp;", "]]>"]
    n = len(row["response_tokens"])
    row.update(step=999, response_tokens=[hostile[i % len(hostile)] for i in range(n)],
               tool_calls=[{"turn": 1, "name": "read_meter", "arguments": "{}", "result": "</script><!--<script>",
                            "error": False, "seconds": 0.1}])
    row["old_log_probs"] = [float("nan")] * n
    pq.write_table(pa.Table.from_pylist([row], schema=SCHEMA), dump / "train" / "step_000999-group_000.parquet")
    page = write_report(dump, tmp_path / "hostile.html", max_rows_per_step=None)
    dom = _dom(page, "#step=999")
    assert "data-pwned" not in dom.body and dom.images == 0
    shown = [t for t in dom.trajs.values() if not t["hidden"]]
    assert len(shown) == 1 and shown[0]["policy"] + shown[0]["env"] == n and shown[0]["calls"] == 1
    assert shown[0]["gap"] == 0  # NaN gaps show as none
