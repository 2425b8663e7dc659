"""The package import graph follows docs/architecture.md's table: every import between packages is allowed there.

Reads every ``import`` statement (module level and inside functions) of ``mcore_agentic/`` and
``megatron_patches/`` with :mod:`ast` and fails on an edge the table does not allow. Leaves any
package may use: ``config.errors`` and ``config.walk`` (errors and the generic dataclass builder)
and ``utils``. Every package's own ``<pkg>.config`` module (light dataclasses) may be imported by
``config`` (the top of the config tree, which composes them).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "utils": set(),
    "algorithms": set(),
    "data": set(),
    "parallel": set(),
    "models": {"parallel"},  # a layer spec chooses parallel.local_attention
    "workers": {"models", "parallel", "algorithms", "data"},
    "tools": set(),
    "interactions": {"tools"},
    "rewards": set(),
    "rollout": {"tools", "interactions", "data"},
    "sharding": {"models", "parallel"},  # collectives go through parallel.comm
    "trainer": {"config", "data", "models", "parallel", "workers", "algorithms", "rollout", "tools", "interactions",
                "rewards", "sharding"},
    "inspect": {"trainer"},  # reads the trainer's dump format (trainer.rollout_dump)
    "megatron_patches": set(),  # megatron-core and torch only; applied by launch/ and tests
}
LEAVES = ("mcore_agentic.utils.errors", "mcore_agentic.utils.walk", "mcore_agentic.utils")
PENDING: set[tuple[str, str]] = set()  # known edges still to remove: none


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "megatron_patches":
        return "megatron_patches"
    if parts[0] == "mcore_agentic" and len(parts) > 1:
        return parts[1]
    return None


def _violations() -> list[str]:
    found = []
    for base in ("mcore_agentic", "megatron_patches"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT)
            src = "megatron_patches" if base == "megatron_patches" else (rel.parts[1] if len(rel.parts) > 2 else None)
            if src is None:  # mcore_agentic/__init__.py
                continue
            for module in _imports(path):
                dst = _package(module)
                if dst is None or dst == src or module.startswith(LEAVES):
                    continue
                if src == "config" and module == f"mcore_agentic.{dst}.config":
                    continue  # the config tree composes every package's own config module
                if dst in ALLOWED[src] or (src, module) in PENDING:
                    continue
                found.append(f"{rel}: {src} -> {module}")
    return found


def test_every_import_between_packages_is_allowed_by_the_table():
    assert set(ALLOWED) >= {p.name for p in (ROOT / "mcore_agentic").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert _violations() == []


def test_the_pending_edges_still_exist():
    # When one is removed, drop it from PENDING so that it cannot come back.
    for src, module in PENDING:
        assert any(module in _imports(p) for p in (ROOT / "mcore_agentic" / src).rglob("*.py")), (src, module)
