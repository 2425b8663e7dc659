"""``python -m mcore_agentic.inspect DUMP_DIR --out report.html``: a self-contained token-level report of a dump."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_agentic.inspect",
        description="Write one self-contained HTML report of the trajectory dumps under DUMP_DIR "
        "(trainer.rollout_data_dir): every token coloured by loss mask, log-prob gaps, tool calls, filters.",
    )
    parser.add_argument("dump_dir", help="a trainer.rollout_data_dir (its train/ and val/ parquet files)")
    parser.add_argument("--out", default="report.html", help="the HTML file to write (default: report.html)")
    parser.add_argument("--gap-threshold", type=float, default=0.5,
                        help="highlight sampled tokens whose |rollout - trainer log-prob| exceeds this (default 0.5)")
    parser.add_argument("--max-rows-per-step", type=int, default=64,
                        help="trajectories shown per step and split; 0 shows all (default 64)")
    args = parser.parse_args(argv)
    from mcore_agentic.inspect.report import write_report

    try:
        out = write_report(args.dump_dir, args.out, gap_threshold=args.gap_threshold,
                           max_rows_per_step=args.max_rows_per_step or None)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
