"""bench/rollout_tokenization.py runs: every column (the "before" baseline included) at tiny sizes prints its row.

Timings are not checked (docs/benchmarks.md has them); this only keeps the bench runnable as the code under it
changes (its "before" once stopped on a changed ``sanity_check`` signature).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_bench_prints_its_table_at_tiny_sizes() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "bench/rollout_tokenization.py", "--turns", "2", "4", "--conversations", "1", "--repeats", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["turns", "tokens", "floor"], r.stdout
    rows = [line.split() for line in lines[1:]]
    assert [row[0] for row in rows] == ["2", "4"], r.stdout
    for row in rows:
        assert "-" not in row[:13], row  # the before column ran too
        assert row[-2:] == [f"1r={row[0]}", "drift=0"], row  # every turn took the one-render path
