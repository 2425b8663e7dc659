"""bench/harness_prefix.py at tiny sizes on the transformers engine: it runs, prints its table, and each later turn
prefills only its new ids + the last sample (vLLM's runs are left to the bench: two engine start-ups, ~40 s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "harness_prefix.py"


def test_harness_bench_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_bench_harness_prefix", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    results = bench.main(["--prefix-tokens", "600", "--turns", "3", "--sample-tokens", "4", "--engines", "hf",
                          "--model-dir", str(tmp_path / "model")])
    hf = results["hf"]
    assert hf["same_ids"]
    reuse, plain = hf["reuse"].turns, hf["plain"].turns
    assert reuse[0].prompt >= 600 and reuse[0].prefilled == reuse[0].new == reuse[0].prompt
    for turn in reuse[1:]:
        assert turn.prefilled == turn.new + 1 <= 1.1 * turn.new  # the new ids and the last sample, never fed
    assert [t.prefilled for t in plain] == [t.prompt for t in plain]
    out = capsys.readouterr().out
    assert "hf reuse vs hf no reuse (same sampled ids: yes)" in out and "turns 2..3: prefilled" in out
