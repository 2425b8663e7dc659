"""The accelerators a plan is made for: memory, bandwidths and peak throughput (vendor datasheets, dense bf16)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_agentic.utils.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    """Memory per GPU that allocations can use (the datasheet's capacity less what the driver keeps)."""
    hbm_tb_s: float
    """Memory bandwidth, TB/s."""
    bf16_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    intra_node_gb_s: float
    """Per-GPU one-direction bandwidth inside a node (NVLink), GB/s."""
    inter_node_gb_s: float
    """Per-GPU one-direction bandwidth between nodes (InfiniBand/RoCE), GB/s."""


DEVICES: dict[str, Device] = {
    # H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 dense bf16 TFLOP/s, NVLink 4 (900 GB/s both ways), 400 Gb/s NIC per GPU.
    "h100-80g": Device("h100-80g", 79.1, 3.35, 989.0, 450.0, 50.0),
    # H200 SXM 141 GB: 4.8 TB/s HBM3e, the H100's compute and links.
    "h200-141g": Device("h200-141g", 139.8, 4.8, 989.0, 450.0, 50.0),
    # B200 180 GB: 8 TB/s HBM3e, 2250 dense bf16 TFLOP/s, NVLink 5 (1.8 TB/s both ways), 400 Gb/s NIC per GPU.
    "b200": Device("b200", 178.0, 8.0, 2250.0, 900.0, 50.0),
}


def get_device(name: str, *, memory_gib: float | None = None) -> Device:
    """A named device (``memory_gib`` overrides its memory: a MIG slice, another SKU)."""
    if name not in DEVICES:
        raise ConfigError("plan.device", f"{name!r} is not known: use one of {', '.join(DEVICES)}, and "
                                         "--memory-gib for another memory size")
    device = DEVICES[name]
    if memory_gib is not None:
        device = Device(device.name, float(memory_gib), device.hbm_tb_s, device.bf16_tflops, device.intra_node_gb_s,
                        device.inter_node_gb_s)
    return device
