"""``python -m mcore_agentic.plan [options] [hydra overrides]``: will the run fit, and how long will a step take?

    python -m mcore_agentic.plan model=qwen3_30b_a3b --nodes 4 --gpus-per-node 8 --device h100-80g
    python -m mcore_agentic.plan --config-name gsm8k_multiturn_grpo model=qwen3_8b --json

Composes the config exactly as the launcher does (the same defaults, overrides and verl keys), reads the model's
``config.json`` (or the published one of a model ``configs/model/`` names), and prints each phase's memory on its
worst rank, the peak and whether it fits, and the step-time terms. ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from mcore_agentic.utils.errors import ConfigError


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m mcore_agentic.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-name", default="default_tiny")
    p.add_argument("--config-dir", default=None, help="a directory of your own YAML configs (searched first)")
    p.add_argument("--device", default="h100-80g", help="h100-80g, h200-141g or b200")
    p.add_argument("--memory-gib", type=float, default=None, help="usable memory per GPU (overrides the device's)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--headroom", type=float, default=0.05, help="fraction of each GPU's memory to keep free")
    p.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation of the training passes")
    p.add_argument("--mean-length", type=int, default=None,
                   help="an average sequence's tokens (prompt + response) for the step time (default: the longest)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--suggest", type=int, default=None, metavar="N",
                   help="the N fastest layouts and offload settings that fit (default: 3 when the run does not fit)")
    p.add_argument("--placements", action="store_true",
                   help="rank colocated against each split of the GPUs between trainer and rollout ranks")
    return p.parse_known_args(argv)


def compose(config_name: str, overrides: list[str], config_dir: str | None = None) -> Any:
    """The run's ``RLConfig``, composed as the launcher composes it (:func:`mcore_agentic.config.compose`: verl keys
    rewritten, the same defaults; a user's config directory searched before the repository's)."""
    from omegaconf import OmegaConf

    from mcore_agentic.config import CONFIG_DIR, load_config
    from mcore_agentic.config import compose as compose_tree
    from mcore_agentic.config.load import translate_overrides
    from mcore_agentic.trainer.config import log_dir_of

    OmegaConf.register_new_resolver("log_dir", log_dir_of, replace=True)
    native, _ = translate_overrides(overrides)
    searched = [f"hydra.searchpath=[file://{CONFIG_DIR}]"] if config_dir else []
    try:
        tree = compose_tree(config_name, [*native, *searched], config_dir)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- Hydra's composition errors: one line naming the config
        from mcore_agentic.utils.errors import first_line

        where = config_dir or CONFIG_DIR
        raise ConfigError(f"--config-name {config_name}", f"{first_line(exc)} (config directory {where})") from None
    return load_config(tree, overrides=native, log_aliases=False)


def render(plan: Any, suggestions: list[Any] | None = None) -> None:
    """The plan as rich tables: phases (with their parts), then the step time."""
    from rich.console import Console
    from rich.table import Table

    gib = 1024**3
    console = Console()
    usable = plan.capacity_bytes * (1 - plan.headroom)
    table = Table(title=f"{plan.layout} on {plan.world_size} x {plan.device} "
                        f"({plan.capacity_bytes / gib:.1f} GiB, {plan.headroom:.0%} kept free)")
    table.add_column("phase")
    table.add_column("GiB per GPU (worst rank)", justify="right")
    table.add_column("of which")
    for phase in plan.phases:
        parts = ", ".join(f"{name} {b / gib:.2f}" for name, b in phase.parts.items() if b)
        mark = " <- peak" if phase is plan.peak else ""
        table.add_row(phase.name + mark, f"{phase.bytes / gib:.2f}", parts)
    console.print(table)
    if plan.engine is not None:
        e = plan.engine
        console.print(f"engine: {e.share_bytes / gib:.1f} GiB share = weights {e.weight_bytes / gib:.2f} + KV cache "
                      f"{e.kv_bytes / gib:.2f} ({e.kv_tokens:,} tokens: {e.concurrent_sequences} sequences of the "
                      "longest length at once) + activations")
    if plan.fits:
        verdict = "fits"
    elif plan.peak.bytes > usable:
        verdict = f"does NOT fit: {(plan.peak.bytes - usable) / gib:.2f} GiB short"
    else:
        verdict = "does NOT fit: the engine's share holds no sequence (see the note)"
    console.print(f"peak: {plan.peak.name}, {plan.peak.bytes / gib:.2f} GiB of {usable / gib:.2f} usable -> {verdict}")
    times = Table(title="step time (estimate)")
    times.add_column("term")
    times.add_column("seconds", justify="right")
    for term, s in sorted(plan.step_seconds.items(), key=lambda kv: -kv[1]):
        times.add_row(term, f"{s:.2f}")
    times.add_row("total" + (" (the slower of generation and training: separate placement)"
                             if plan.generation_terms else ""), f"{plan.total_seconds:.2f}")
    console.print(times)
    for note in plan.notes:
        console.print(f"note: {note}")
    if suggestions is not None:
        if not suggestions:
            console.print("no layout or offload setting of this batch fits: shorten the micro-batches or add GPUs")
            return
        best = Table(title="layouts that fit, fastest first (python -m mcore_agentic.plan --suggest N)")
        best.add_column("overrides")
        best.add_column("TP x PP x EP", justify="right")
        best.add_column("peak GiB", justify="right")
        best.add_column("step s", justify="right")
        for s in suggestions:
            best.add_row(" ".join(s.overrides), str(s.model_parallel), f"{s.peak_bytes / gib:.1f}", f"{s.step_seconds:.2f}")
        console.print(best)


def main(argv: list[str] | None = None) -> int:
    args, overrides = _args(sys.argv[1:] if argv is None else argv)
    from mcore_agentic.plan.check import placements_for, plan_for, suggestions_for

    world = args.nodes * args.gpus_per_node
    try:
        cfg = compose(args.config_name, overrides, args.config_dir)
        plan = plan_for(cfg, device=args.device, memory_gib=args.memory_gib, world_size=world,
                        headroom=args.headroom, mfu=args.mfu, mean_length=args.mean_length)
        wanted = args.suggest if args.suggest is not None else (0 if plan.fits else 3)
        suggestions = suggestions_for(cfg, device=args.device, memory_gib=args.memory_gib, world_size=world,
                                      headroom=args.headroom, mfu=args.mfu, limit=wanted) if wanted else None
        options = placements_for(cfg, device=args.device, memory_gib=args.memory_gib, world_size=world,
                                 headroom=args.headroom, mfu=args.mfu,
                                 mean_length=args.mean_length) if args.placements else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = plan.to_json()
        if suggestions is not None:
            out["suggestions"] = [dataclasses.asdict(s) for s in suggestions]
        if options is not None:
            out["placements"] = [dataclasses.asdict(o) for o in options]
        print(json.dumps(out, indent=2))
    else:
        render(plan, suggestions)
        if options is not None:
            render_placements(options)
    return 0


def render_placements(options: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="placements of the job's GPUs, fastest that fits first (python -m mcore_agentic.plan "
                        "--placements)")
    for column in ("overrides", "generation s", "training s", "step s", "peak GiB", "fits"):
        table.add_column(column, justify="left" if column == "overrides" else "right")
    for o in options:
        table.add_row(" ".join(o.overrides), f"{o.generation_seconds:.2f}", f"{o.training_seconds:.2f}",
                      f"{o.total_seconds:.2f}", f"{o.peak_bytes / 1024**3:.1f}", "yes" if o.fits else "no")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
