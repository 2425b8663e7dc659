"""The communication policy (``parallel/comm.py``): strict mode refuses raw collectives from product code and
tensors placed against the policy; host and device calls give the right values on gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[3]
PRODUCT_FILE = str(ROOT / "mcore_agentic" / "trainer" / "distribute.py")


def _raw_all_reduce_from(filename: str) -> None:
    """Run ``dist.all_reduce`` from code whose frames say it lives in ``filename``."""
    code = compile("dist.all_reduce(t)", filename, "exec")
    exec(code, {"dist": dist, "t": torch.ones(1)})


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    """Each misuse, on a world of one (a refused call raises before any peer could wait on it)."""
    out: dict[str, str] = {"strict": str(comm.strict())}
    cases = {
        "raw_from_product": lambda: _raw_all_reduce_from(PRODUCT_FILE),
        "raw_from_launch": lambda: _raw_all_reduce_from(str(ROOT / "launch" / "pretrain_rl.py")),
        "host_untagged": lambda: comm.all_reduce_host(torch.zeros(2)),
        "host_device_tagged": lambda: comm.all_reduce_host(comm.device_zeros(2, dtype=torch.float32)),
        "device_receive_untagged": lambda: comm.all_gather_device([torch.zeros(2)], torch.ones(2)),
        "device_host_tagged": lambda: comm.all_reduce_device(comm.host_zeros(2, dtype=torch.float32)),
        "as_device_of_host": lambda: comm.as_device(comm.to_host([1.0])),
        "p2p_untagged": lambda: comm.exchange_host([(torch.ones(1), 0, 0)], []),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "ok"
        except comm.CommPolicyError as exc:
            out[name] = f"refused: {exc}"
    _raw_all_reduce_from(__file__)  # tests (and megatron-core, torch) call torch.distributed directly
    out["raw_from_test"] = "ok"
    return out


def test_strict_mode_refuses_collectives_outside_the_policy_in_spawned_ranks():
    (out,) = run_distributed(_refusals, world_size=1, timeout=120)
    assert out.pop("strict") == "True", "the suite's strict mode must reach spawned ranks"
    assert out.pop("raw_from_test") == "ok"
    for name, result in out.items():
        assert result.startswith("refused"), (name, result)
    assert "distribute.py:1" in out["raw_from_product"] and "parallel.comm" in out["raw_from_product"]
    assert "receive buffer" in out["device_receive_untagged"]


def _calls(rank: int, world_size: int) -> dict[str, object]:
    host = comm.all_reduce_host(comm.to_host([rank + 1.0, 2.0 * rank], torch.float64))
    gathered = comm.all_gather_host(comm.to_host([rank, 10 + rank], torch.long))
    flag = comm.broadcast_host(comm.to_host([rank * 7], torch.long), src=1)
    buf = comm.host_empty(3, dtype=torch.float32)
    other = 1 - rank
    comm.exchange_host([(comm.to_host([float(rank)] * 3, torch.float32), other, 5)], [(buf, other, 5)])
    payload = comm.as_device(torch.arange(4.0) + 10 * rank)
    comm.all_reduce_device(payload)
    recv = comm.device_zeros(2, dtype=torch.float32) if rank == 0 else comm.as_device(torch.tensor([3.0, 4.0]))
    comm.broadcast_device(recv, group=dist.group.WORLD, group_src=1)
    scattered = comm.reduce_scatter_device(torch.arange(4.0).reshape(4, 1) * (rank + 1), group=dist.group.WORLD)
    comm.barrier()
    return {
        "host": host.tolist(), "gathered": [g.tolist() for g in gathered], "flag": flag.tolist(),
        "p2p": buf.tolist(), "payload": payload.tolist(), "bcast": recv.tolist(),
        "scattered": scattered.reshape(-1).tolist(), "obj": comm.broadcast_object({"r": rank}, group_src=1),
        "objs": comm.all_gather_object(rank * 3),
    }


def test_host_and_device_calls_give_the_collective_results():
    r0, r1 = run_distributed(_calls, world_size=2, timeout=180)
    for r, out in enumerate((r0, r1)):
        assert out["host"] == [3.0, 2.0]
        assert out["gathered"] == [[0, 10], [1, 11]]
        assert out["flag"] == [7]
        assert out["p2p"] == [float(1 - r)] * 3
        assert out["payload"] == [10.0, 12.0, 14.0, 16.0]
        assert out["bcast"] == [3.0, 4.0]
        assert out["obj"] == {"r": 1}
        assert out["objs"] == [0, 3]
    assert r0["scattered"] == [0.0, 3.0] and r1["scattered"] == [6.0, 9.0]  # (1 + 2) x arange(4), split in two


def test_policy_paths_and_backend():
    assert comm.bypasses_policy(PRODUCT_FILE)
    assert not comm.bypasses_policy(str(ROOT / "mcore_agentic" / "parallel" / "comm.py"))
    assert not comm.bypasses_policy(__file__)
    assert not comm.bypasses_policy(torch.__file__)
    assert not comm.bypasses_policy("<string>")
    assert comm.backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert comm.backend_for("cpu") == "gloo"


def test_host_placement_copies_and_tags():
    t = torch.arange(3, dtype=torch.float32)
    h = comm.to_host(t, torch.float64)
    assert h.dtype == torch.float64 and comm.place_of(h) == comm.HOST and comm.place_of(t) is None
    h[0] = 5
    assert t[0] == 0, "to_host copies"
    with pytest.raises(comm.CommPolicyError, match="host calls take CPU tensors"):
        comm._check_host(torch.empty(1, device="meta"), "x")


def test_no_product_source_calls_torch_distributed_collectives_directly():
    """The static half of strict mode: ``isend`` / ``irecv`` / ``P2POp`` cannot be patched (``P2POp`` checks its op
    by identity), so the source is scanned for every collective name outside ``parallel/comm.py``."""
    import ast

    names = set(comm._GUARDED) | {"isend", "irecv", "P2POp"}
    found = []
    for path in [*(ROOT / "mcore_agentic").rglob("*.py"), *(ROOT / "launch").rglob("*.py")]:
        if path.name == "comm.py" and path.parent.name == "parallel":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                base = ast.unparse(node.value)
                if base in ("dist", "torch.distributed"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {base}.{node.attr}")
    assert not found, found
