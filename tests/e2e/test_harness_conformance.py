"""The conformance table in docs/agents.md cannot go stale: ``bench/harness_conformance.py`` writes it (every
harness as shipped, from its recipe, under every chat template, through the real ``AgentSource`` and endpoint), and
this re-runs every harness under qwen2_5 and Codex (the Responses API: custom tools, reasoning passed back) under the
other two templates (six of the twelve rows, for the suite's time) and checks those rows of the documented table:
runs to the end, samples, forks, side requests and exactness must be what the run gives; the prefix-reuse share and the first prompt's size are measured figures (the prompts carry the date
and the harness's paths) and must stay within a few points. Skips, with the reason, where the harnesses are not
installed (``make harnesses``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import harness_conformance as conformance  # noqa: E402

DOC = ROOT / "docs" / "agents.md"


def _documented() -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(conformance.HEADER) and cells[0] in conformance.HARNESSES:
            rows[(cells[0], cells[1])] = cells
    return rows


@pytest.mark.timeout(600)
def test_the_documented_conformance_table_is_what_the_harnesses_do():
    missing = [b for b, *_ in conformance.HARNESSES.values() if not (conformance.HARNESS_BIN / b).exists()]
    if missing:
        pytest.skip(f"{missing} not installed under {conformance.HARNESS_BIN} (make harnesses)")
    documented = _documented()
    assert set(documented) == {(h, t) for h in conformance.HARNESSES for t in conformance.TEMPLATES}, (
        "docs/agents.md should hold every harness x template: python bench/harness_conformance.py --jobs 2")
    rows = conformance.run_all(list(conformance.HARNESSES), ["qwen2_5"], jobs=2)  # every harness, one template
    rows += conformance.run_all(["codex"], ["qwen3", "qwen3_coder"], jobs=2)  # and every template, one harness
    table = conformance.table(rows)
    for row in rows:
        got, doc = row.cells(), documented[(row.harness, row.template)]
        assert got[:7] == doc[:7], f"{row.harness} x {row.template}: {got} != {doc}; docs/agents.md should hold:\n{table}"
        assert abs(row.prefix * 100 - float(re.sub("%", "", doc[7]))) < 2.0, (got, doc)
        assert abs(row.first_prompt - int(doc[8])) <= 0.05 * int(doc[8]), (got, doc)
        assert row.ends and row.exact and row.prefix > 0.95  # the bar, whatever the docs say
