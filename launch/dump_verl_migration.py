"""Regenerate docs/verl_migration.md (verl's keys and their names here) from mcore_agentic/config/verl_keys.py.

    python launch/dump_verl_migration.py           # write the file
    python launch/dump_verl_migration.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mcore_agentic.config.verl_keys import render_markdown  # noqa: E402

TARGET = REPO / "docs" / "verl_migration.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report a stale file (exit status 1)")
    args = parser.parse_args()
    text = render_markdown()
    if TARGET.is_file() and TARGET.read_text() == text:
        return 0
    if args.check:
        print(f"stale (run python launch/dump_verl_migration.py): {TARGET.relative_to(REPO)}")
        return 1
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
