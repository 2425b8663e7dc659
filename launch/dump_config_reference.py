"""Regenerate configs/ppo_trainer.yaml and docs/configuration.md from the config dataclasses' field docs.

    python launch/dump_config_reference.py           # write both files
    python launch/dump_config_reference.py --check   # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mcore_agentic.config.reference import render_markdown, render_yaml  # noqa: E402

TARGETS = {REPO / "configs" / "ppo_trainer.yaml": render_yaml, REPO / "docs" / "configuration.md": render_markdown}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit status 1)")
    args = parser.parse_args()
    stale = []
    for path, render in TARGETS.items():
        text = render()
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if args.check and stale:
        print("stale (run python launch/dump_config_reference.py): " + ", ".join(str(p.relative_to(REPO)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
