"""Write the synthetic tool-arithmetic task to disk: train/val parquet and SFT demonstrations.

    python launch/make_synthetic_task.py --out data/synthetic --num-train 512 --num-val 64 --seed 1234

Produces ``train.parquet`` and ``val.parquet`` (rows as ``mcore_agentic.data.dataset`` reads them)
and ``sft.jsonl`` (one ideal conversation per line, ``{"messages": [...]}``). The embedded
default does not need these files (``data.synthetic.enable=true`` generates the same rows in
memory); they are for inspection and for training with ``data.train_files``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_agentic.data.config import SyntheticTaskConfig  # noqa: E402
from mcore_agentic.data.dataset import write_parquet  # noqa: E402
from mcore_agentic.data.synthetic import ideal_conversation, make_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    defaults = SyntheticTaskConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=defaults.num_train)
    parser.add_argument("--num-val", type=int, default=defaults.num_val)
    parser.add_argument("--min-operand", type=int, default=defaults.min_operand)
    parser.add_argument("--max-operand", type=int, default=defaults.max_operand)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    cfg = SyntheticTaskConfig(
        enable=True,
        num_train=args.num_train,
        num_val=args.num_val,
        min_operand=args.min_operand,
        max_operand=args.max_operand,
        seed=args.seed,
    )
    train, val = make_rows(cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    write_parquet(train, args.out / "train.parquet")
    if val:
        write_parquet(val, args.out / "val.parquet")
    with open(args.out / "sft.jsonl", "w") as f:
        for row in train:
            f.write(json.dumps({"messages": ideal_conversation(row)}) + "\n")
    print(f"wrote {len(train)} train / {len(val)} val rows and {len(train)} demonstrations to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
