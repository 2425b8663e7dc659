"""Code tool throughput: sandboxed executions vs an unsandboxed ``python -c`` baseline, same run, same code.

Each execution runs ``print(sum(range(10**5)))`` and must print ``4999950000``.

* ``baseline``: ``subprocess.run([python, "-I", "-c", code])``, no isolation, no limits;
* ``bwrap, cold``: the code tool's sandbox with ``warm_pool: 0`` (bwrap + interpreter boot per call);
* ``bwrap, warm pool``: the default, ``warm_pool: 2`` (the interpreter of the next sandbox boots ahead).

Concurrency ``c`` means ``c`` executions in flight at once (threads for the baseline, the
tool's executor with ``c`` slots for the sandbox); each row runs ``--calls`` executions. The three
are measured ``--repeats`` times, interleaved (baseline, cold, warm, baseline, ...), and each
column is the median: on a 2-core machine a single run of the baseline varies by +-20%.

The header line says how the sandbox ran here: its host user (a dedicated uid per execution when
the bench runs as root) and what bounds its memory (a memory cgroup, or denied routes).

Usage: ``python bench/code_tool.py [--calls 96] [--concurrency 1 32] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import subprocess
import sys
import time

from mcore_agentic.tools.base import safe_execute
from mcore_agentic.tools.code_interpreter import PythonCodeTool
from mcore_agentic.tools.executor import LocalExecutor
from mcore_agentic.tools.sandbox import get_sandbox

CODE = "print(sum(range(10**5)))"
EXPECTED = "4999950000"
SCHEMA = {"type": "function", "function": {"name": "code_interpreter"}}


def baseline(calls: int, concurrency: int) -> float:
    def one(_: int) -> None:
        out = subprocess.run([sys.executable, "-I", "-c", CODE], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == EXPECTED

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(calls)))
    return calls / (time.perf_counter() - started)


def sandboxed(calls: int, concurrency: int, warm_pool: int) -> float:
    executor = LocalExecutor(max_workers=concurrency)
    tool = PythonCodeTool({"warm_pool": warm_pool, "timeout_s": 60}, SCHEMA)
    tool.bind_executor(executor)

    async def main() -> list:
        return await asyncio.gather(*(safe_execute(tool, f"r{i}", {"code": CODE}) for i in range(calls)))

    try:
        time.sleep(0.5)  # let the warm pool boot, as it would between rollout steps
        started = time.perf_counter()
        results = asyncio.run(main())
        elapsed = time.perf_counter() - started
    finally:
        executor.shutdown()
    assert all(r.text == EXPECTED and r.metrics["sandboxed"] == 1 for r in results), results[0]
    return calls / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sandboxed(8, 2, warm_pool=2)  # warm-up: imports, page cache
    sandbox = get_sandbox(PythonCodeTool({"warm_pool": 2, "timeout_s": 60}, SCHEMA).limits)
    host_user = sandbox._host_user
    who = "a dedicated uid per execution" if host_user.drops_root else f"uid {host_user.trainer_uid}"
    print(f"sandbox: runs as {who}; memory: {sandbox.memory_bound}; medians of {args.repeats} interleaved runs\n")
    print("| concurrency | baseline exec/s | bwrap cold exec/s | cold / baseline | bwrap warm pool exec/s | warm / baseline |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        runs: dict[str, list[float]] = {"base": [], "cold": [], "warm": []}
        for _ in range(args.repeats):
            runs["base"].append(baseline(args.calls, c))
            runs["cold"].append(sandboxed(args.calls, c, warm_pool=0))
            runs["warm"].append(sandboxed(args.calls, c, warm_pool=2))
        base, cold, warm = (statistics.median(runs[k]) for k in ("base", "cold", "warm"))
        print(f"| {c} | {base:.1f} | {cold:.1f} | {cold / base:.2f}x | {warm:.1f} | {warm / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
