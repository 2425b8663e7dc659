"""GPU review m3: ``trainer.plan_check`` plans for the GPU CUDA will use — ``CUDA_VISIBLE_DEVICES``' first entry (an
index or a UUID), a MIG slice's own memory — and names a GPU the planner does not know instead of planning it as an
H100 SXM. The parsers are fed what ``nvidia-smi`` prints; :func:`local_gpu` runs a stand-in ``nvidia-smi`` that
answers each of its calls as the real one does."""

from __future__ import annotations

import logging

import pytest

from mcore_agentic.plan import check
from mcore_agentic.plan.check import local_gpu
from mcore_agentic.plan.devices import get_device

# `nvidia-smi -L` on a workstation with an H100 PCIe beside an H100 SXM (the order of the PCI bus).
MIXED = """\
GPU 0: NVIDIA H100 PCIe (UUID: GPU-2f6c1a7e-9b3d-4e58-a1c0-7d4b8e2f9a61)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b81e4d3a-6c2f-4a97-8e15-3f0d9c7a2b44)
"""
# `nvidia-smi --id=N --query-gpu=name,memory.total --format=csv,noheader,nounits` for each.
MIXED_QUERY = {0: "NVIDIA H100 PCIe, 81559\n", 1: "NVIDIA H100 80GB HBM3, 81559\n"}

# `nvidia-smi -L` with MIG on the first GPU (two slices) and not on the second.
MIG = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)
  MIG 1g.10gb     Device  1: (UUID: MIG-cba663e8-9bed-5b7e-8e3a-4ad6c7e27e3b)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-0e9a7c51-3d2b-4f86-b7a4-92c1e5d08f37)
  MIG 1g.10gb     Device  0: (UUID: MIG-7a3f2e91-0c4b-5d68-9e17-b25c84f60a13)
"""
MIG_QUERY = {0: "NVIDIA A100-SXM4-80GB, 81920\n", 1: "NVIDIA H100 80GB HBM3, 81559\n"}
# `nvidia-smi --id=0 -q` of the MIG GPU (abridged to the sections around the slices; the GPU's own memory follows them).
MIG_Q0 = """\

==============NVSMI LOG==============

Timestamp                                 : Tue Mar  4 10:12:45 2025
Driver Version                            : 550.127.05
CUDA Version                              : 12.4

Attached GPUs                             : 2
GPU 00000000:07:00.0
    Product Name                          : NVIDIA A100-SXM4-80GB
    Product Brand                         : NVIDIA
    MIG Mode
        Current                           : Enabled
        Pending                           : Enabled
    MIG Devices
        MIG Device
            Index                         : 0
            GPU Instance ID               : 2
            Compute Instance ID           : 0
            Device Attributes
                Shared
                    Multiprocessor count  : 42
                    Copy Engine count     : 3
                    Encoder count         : 0
                    Decoder count         : 2
                    OFA count             : 0
                    JPG count             : 0
            ECC Errors
                Volatile
                    SRAM Uncorrectable    : 0
            FB Memory Usage
                Total                     : 40192 MiB
                Reserved                  : 0 MiB
                Used                      : 37 MiB
                Free                      : 40154 MiB
            BAR1 Memory Usage
                Total                     : 32767 MiB
                Used                      : 0 MiB
                Free                      : 32767 MiB
        MIG Device
            Index                         : 1
            GPU Instance ID               : 13
            Compute Instance ID           : 0
            Device Attributes
                Shared
                    Multiprocessor count  : 14
                    Copy Engine count     : 1
                    Encoder count         : 0
                    Decoder count         : 0
                    OFA count             : 0
                    JPG count             : 0
            ECC Errors
                Volatile
                    SRAM Uncorrectable    : 0
            BAR1 Memory Usage
                Total                     : 8191 MiB
                Used                      : 0 MiB
                Free                      : 8191 MiB
    Accounting Mode                       : Disabled
    FB Memory Usage
        Total                             : 81920 MiB
        Reserved                          : 562 MiB
        Used                              : 37 MiB
        Free                              : 81320 MiB
"""


def test_the_visible_device_is_cuda_visible_devices_first_entry():
    visible, sxm = check.visible_gpu, check.VisibleGpu(1, "NVIDIA H100 80GB HBM3")
    assert visible(MIXED, None) == check.VisibleGpu(0, "NVIDIA H100 PCIe")
    assert visible(MIXED, "1,0") == sxm
    assert visible(MIXED, "GPU-b81e4d3a-6c2f-4a97-8e15-3f0d9c7a2b44") == sxm
    assert visible(MIXED, "GPU-b81e4d3a") == sxm  # a prefix, as CUDA takes it
    assert visible(MIXED, "") is None  # nothing visible
    assert visible(MIXED, "2") is None and visible(MIXED, "GPU-ffff") is None and visible("", None) is None


def test_a_mig_slice_is_the_visible_device():
    visible, gpu = check.visible_gpu, check.VisibleGpu
    a100, h100 = "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"
    assert visible(MIG, "MIG-cba663e8-9bed-5b7e-8e3a-4ad6c7e27e3b") == gpu(0, a100, 1, "1g.10gb")
    assert visible(MIG, "MIG-7a3f") == gpu(1, h100, 0, "1g.10gb")
    assert visible(MIG, None) == gpu(0, a100, 0, "3g.40gb")  # a GPU in MIG mode: its first slice
    assert visible(MIG, "1") == gpu(1, h100, 0, "1g.10gb")


def test_a_slices_memory_is_its_own():
    assert check.mig_memory_mib(MIG_Q0, 0) == 40192.0
    assert check.mig_memory_mib(MIG_Q0, 1) is None  # none listed for it (not its GPU's, after the section)
    assert check.mig_memory_mib(MIG_Q0, 2) is None
    assert check.mig_memory_mib(MIG_Q0.split("    MIG Devices")[0], 0) is None


@pytest.mark.parametrize("name, kind", [
    ("NVIDIA H100 80GB HBM3", "h100-80g"),  # what an H100 SXM5 calls itself
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H800", None), ("NVIDIA A100-SXM4-80GB", None),
    ("NVIDIA H200", "h200-141g"), ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA B200", "b200"), ("NVIDIA GB200", None), ("NVIDIA L40S", None),
])
def test_names_map_to_the_planners_devices_or_to_none(name: str, kind: str | None):
    assert check.known_kind(name) == kind


def test_an_unknown_gpu_is_named_as_such_and_warned_of():
    device, notes = check.gpu_device("NVIDIA H100 PCIe", 81559)
    assert device.name == "NVIDIA H100 PCIe (not known to the planner: h100-80g's bandwidths)"
    assert device.memory_gib == 81559 / 1024 and len(notes) == 1 and "not a GPU the planner knows" in notes[0]
    device, notes = check.gpu_device("NVIDIA H100 80GB HBM3", 40192, "3g.40gb")
    assert device.name == "NVIDIA H100 80GB HBM3 MIG 3g.40gb (as h100-80g)" and device.memory_gib == 40192 / 1024
    assert notes == ["MIG 3g.40gb of NVIDIA H100 80GB HBM3: its own memory, its whole GPU's bandwidths and throughput"]


def _stand_in(tmp_path, monkeypatch, listing: str, query: dict[int, str], q: dict[int, str]) -> None:
    """A stand-in ``nvidia-smi`` on PATH answering ``-L``, ``--id=N --query-gpu=...``, ``--id=N -q`` and a query of
    every GPU (a missing answer fails as the real one does), each call's arguments appended to ``tmp_path/calls``."""
    (tmp_path / "L").write_text(listing)
    for i, text in query.items():
        (tmp_path / f"query{i}").write_text(text)
    for i, text in q.items():
        (tmp_path / f"q{i}").write_text(text)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
PATH=/usr/bin:/bin
echo "$*" >> {tmp_path}/calls
case "$*" in
  -L) exec cat {tmp_path}/L ;;
  --id=*" -q") exec cat {tmp_path}/q"${{1#--id=}}" ;;
  --id=*) exec cat {tmp_path}/query"${{1#--id=}}" ;;
  --query-gpu=*) exec cat {tmp_path}/query* ;;
esac
exit 6
""")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def _calls(tmp_path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_local_gpu_asks_for_the_visible_gpu(tmp_path, monkeypatch, caplog):
    _stand_in(tmp_path, monkeypatch, MIXED, MIXED_QUERY, {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpu = local_gpu()
    assert gpu is not None and gpu.name == "NVIDIA H100 80GB HBM3 (as h100-80g)"
    assert gpu.hbm_tb_s == get_device("h100-80g").hbm_tb_s
    assert _calls(tmp_path) == ["-L", "--id=1 --query-gpu=name,memory.total --format=csv,noheader,nounits"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2f6c1a7e")
    with caplog.at_level(logging.WARNING, logger="mcore_agentic.plan.check"):
        gpu = local_gpu()
    assert gpu is not None and gpu.name == "NVIDIA H100 PCIe (not known to the planner: h100-80g's bandwidths)"
    assert any("NVIDIA H100 PCIe is not a GPU the planner knows" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpu() is None


def test_local_gpu_plans_a_mig_slice_with_its_memory(tmp_path, monkeypatch, caplog):
    _stand_in(tmp_path, monkeypatch, MIG, MIG_QUERY, {0: MIG_Q0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f")
    gpu = local_gpu()
    assert gpu is not None and gpu.memory_gib == 40192 / 1024
    assert gpu.name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb (not known to the planner: h100-80g's bandwidths)"
    assert _calls(tmp_path)[-1] == "--id=0 -q"
    # A slice whose memory nvidia-smi -q does not give: its profile's nominal size, said so.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cba663e8")
    with caplog.at_level(logging.WARNING, logger="mcore_agentic.plan.check"):
        gpu = local_gpu()
    assert gpu is not None and gpu.memory_gib == 10.0
    assert any("planned with its profile's nominal 10 GiB" in r.getMessage() for r in caplog.records)
    # No -q answer at all on the second GPU: the same fallback, never the whole GPU's 79.6 GiB.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpu = local_gpu()
    assert gpu is not None and gpu.memory_gib == 10.0 and gpu.name.startswith("NVIDIA H100 80GB HBM3 MIG 1g.10gb")
