"""The package import graph follows docs/architecture.md's table: every import between packages is allowed there.

Reads every ``import`` statement (module level and inside functions) of ``mcore_agentic/`` and
``megatron_patches/`` with :mod:`ast` and fails on an edge the table does not allow. Leaves any
package may use: ``utils`` (errors and the generic dataclass builder among them). Every package's own
``<pkg>.config`` module (light dataclasses) may be imported by ``config`` (the top of the config tree, which
composes them). The packages then stand in floors with every import pointing down, but for one arrow: ``config``
composes ``trainer.config`` while the trainer reads the composed tree (the composition root).
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
    "endpoint": {"rollout", "tools", "data"},  # the session endpoint: agent programs as a rollout source
    "feed": {"data", "parallel", "algorithms", "rollout", "tools", "interactions", "rewards", "endpoint"},  # the rollout side of a step: it builds itself (tools, interactions, data, engines), schedules, scoring, exchange, dumps
    "trainer": {"config", "data", "models", "parallel", "workers", "algorithms", "rollout", "sharding", "feed"},
    "inspect": {"feed"},  # reads the dump format (feed.rollout_dump)
    # The planner composes the config as the launcher does and counts what the bridges build; its census child
    # builds models on the meta device and so applies the CPU patches, like launch/ (the one package that may).
    "plan": {"config", "models", "parallel", "trainer", "megatron_patches"},
    "megatron_patches": set(),  # megatron-core and torch only; applied by launch/ and tests
}
LEAVES = ("mcore_agentic.utils",)
FACADES = {"trainer": {"feed": "mcore_agentic.feed"}}
"""Packages another imports only through its public ``__init__``: the trainer sees the feed's hand-off and
:class:`~mcore_agentic.feed.Feed`, never its schedules, exchange or dumps (so no leader/replica logic can leak back
into the trainer)."""
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
                facade = FACADES.get(src, {}).get(dst)
                if facade is not None and module != facade:
                    found.append(f"{rel}: {src} -> {module} (only {facade} itself)")
                    continue
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


def package_edges() -> set[tuple[str, str]]:
    """Every (importer, imported) pair of packages, module-level and function-level imports alike."""
    edges = set()
    for path in (ROOT / "mcore_agentic").rglob("*.py"):
        rel = path.relative_to(ROOT)
        if len(rel.parts) <= 2:
            continue
        for module in _imports(path):
            dst = _package(module)
            if dst is not None and dst != rel.parts[1] and dst != "megatron_patches":
                edges.add((rel.parts[1], dst))
    return edges


def upward_arrows(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges that point up: those inside a cycle of the package graph (a DAG's floors point every edge down)."""
    reach = {a: {b for x, b in edges if x == a} for a, _ in edges}
    changed = True
    while changed:
        changed = False
        for a in reach:
            more = set().union(*(reach.get(b, set()) for b in reach[a])) - reach[a]
            if more:
                reach[a] |= more
                changed = True
    return {(a, b) for a, b in edges if a in reach.get(b, set())}


def test_the_house_has_floors_and_one_upward_arrow():
    # The composition root: config composes trainer.config and the trainer reads config. Nothing else goes up.
    assert upward_arrows(package_edges()) == {("config", "trainer"), ("trainer", "config")}


def test_the_trainer_asks_no_rank_its_role():
    # Which rank leads a rollout group is the feed's to know; the trainer runs the same algorithm on every rank: no
    # trainer module reads a rank's rollout role or placement (attribute reads, from the syntax tree).
    roles = {"is_leader", "leads", "group_index", "placement", "agent_host"}
    found = [f"{p.relative_to(ROOT)}:{node.lineno} .{node.attr}"
             for p in sorted((ROOT / "mcore_agentic" / "trainer").rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Attribute) and node.attr in roles]
    assert found == []
