"""What a trajectory dump costs a leader: building the table and writing it, parquet (ours) vs JSON lines.

One process, no model: a leader's scored rollout of B synthetic trajectories (log-normal lengths
clipped to 32..2,048 tokens, as ``bench/data_path.py`` makes them) with the trainer's returned
per-token values (old log-probs, advantages). Per batch size:

Both start from the same records (:func:`mcore_agentic.feed.rollout_dump.trajectory_records`:
one dict per row, token lists included; "records s").

* **jsonl** — the baseline, what a plain dump does (verl's ``_dump_generations`` writes one JSON
  object per row): ``json.dumps`` per row into one file;
* **parquet** — ours: the records as a pyarrow table of the dump schema, ``pq.write_table`` (zstd).

Prints seconds and file MiB per format and the parquet / jsonl ratios. On a dump step the leader
pays the records and the table; the file write runs on the background writer thread.

    python bench/rollout_dump.py
    python bench/rollout_dump.py --batches 64,512
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data_path import scored_rollout  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,256,1024", help="trajectories per leader, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mcore_agentic.feed.rollout_dump import SCHEMA, trajectory_records
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer

    args = _args(argv)
    torch.set_num_threads(1)
    tokenizer = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    print(f"{'rows':>6} {'tokens':>9} {'records s':>9} | {'jsonl s':>8} {'MiB':>7} | "
          f"{'table s':>8} {'write s':>8} {'MiB':>7} | {'size ratio':>10} {'time ratio':>10}")
    for rows in [int(b) for b in args.batches.split(",")]:
        batch = scored_rollout(rows, 4, 0, seed=rows)
        batch.meta["tool_log"] = [[] for _ in range(rows)]
        width = batch["prompts"].shape[1]
        lengths = batch["attention_mask"][:, width:].sum(1).tolist()
        returned = {k: [torch.randn(r) for r in lengths] for k in ("old_log_probs", "advantages")}
        tokens = int(batch["attention_mask"].sum())
        best: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                records = trajectory_records(batch, range(rows), step=1, split="train", group=0, weight_version=1,
                                             tokenizer=tokenizer, trainer_fields=returned)
                t1 = time.perf_counter()
                with open(f"{tmp}/d.jsonl", "w") as f:
                    for r in records:
                        f.write(json.dumps(r) + "\n")
                t2 = time.perf_counter()
                table = pa.Table.from_pylist(records, schema=SCHEMA)
                t3 = time.perf_counter()
                pq.write_table(table, f"{tmp}/d.parquet", compression="zstd")
                t4 = time.perf_counter()
                for key, seconds in (("records", t1 - t0), ("jsonl", t2 - t1), ("table", t3 - t2), ("write", t4 - t3)):
                    best[key] = min(best.get(key, 1e9), seconds)
            sizes = {k: Path(f"{tmp}/d.{k}").stat().st_size / 2**20 for k in ("parquet", "jsonl")}
        ours = best["table"] + best["write"]
        print(f"{rows:>6} {tokens:>9} {best['records']:>9.3f} | {best['jsonl']:>8.3f} {sizes['jsonl']:>7.2f} | "
              f"{best['table']:>8.3f} {best['write']:>8.3f} {sizes['parquet']:>7.2f} | "
              f"{sizes['parquet'] / sizes['jsonl']:>10.3f} {ours / best['jsonl']:>10.3f}")


if __name__ == "__main__":
    main()
