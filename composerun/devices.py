"""Accelerators composerun knows by name: their datasheet figures, for MFU (train/throughput.py)
and for the pre-flight estimate (`plan.device=H100`, parallel/estimate.py).

Each figure is the vendor's datasheet value for the SXM (or the named) part: memory as
`torch.cuda.get_device_properties(...).total_memory` reports it (nvidia-smi's total), dense
(no sparsity) bf16 tensor-core FLOP/s (the datasheets' "with sparsity" figures halved), memory
bandwidth, the per-direction bandwidth of one GPU's NVLink (PCIe where it has none), which
the estimate takes for every collective unless `plan.link_gbps` says otherwise, and the fp32
(not TF32) peak, for the products of an fp32 run.  `pattern`
matches `torch.cuda.get_device_name()`; the first device that matches is the one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    pattern: str  # a regex of torch.cuda.get_device_name() (and of plan.device, case-insensitive)
    memory_gib: float
    bf16_flops: float  # dense bf16 peak, FLOP/s
    memory_gbs: float  # memory bandwidth, GB/s
    link_gbps: float  # one GPU's interconnect per direction, Gbit/s
    fp32_flops: float  # fp32 (no TF32) peak, FLOP/s
    internode_gbps: float = 400.0  # one GPU's inter-node NIC per direction, Gbit/s


_KNOWN = [
    # NVIDIA H100 datasheet: H100 NVL 1,671 TFLOPS bf16 sparse, 3.9 TB/s, 94 GB, NVLink bridge 600 GB/s (both ways)
    Device("H100-NVL", r"H100.*NVL", 93.1, 835e12, 3900, 2400, 60e12),
    # H100 PCIe: 1,513 TFLOPS sparse, 2 TB/s, 80 GB, PCIe Gen5 128 GB/s (both ways)
    Device("H100-PCIe", r"H100.*(PCIe|PCI-E)", 79.2, 756e12, 2000, 512, 51e12),
    # H100 SXM ("NVIDIA H100 80GB HBM3"): 1,979 TFLOPS sparse, 3.35 TB/s, 80 GB, NVLink 900 GB/s (both ways)
    Device("H100", r"H100", 79.6, 989.4e12, 3350, 3600, 67e12),
    # H200 NVL: 1,671 TFLOPS sparse, 4.8 TB/s, 141 GB, NVLink bridge 900 GB/s
    Device("H200-NVL", r"H200.*NVL", 139.8, 835e12, 4800, 3600, 60e12),
    # H200 SXM: 1,979 TFLOPS sparse, 4.8 TB/s, 141 GB, NVLink 900 GB/s
    Device("H200", r"H200", 139.8, 989.4e12, 4800, 3600, 67e12),
    # B200 (HGX): 4.5 PFLOPS fp16/bf16 sparse per GPU, 8 TB/s, 180 GB, NVLink 5 1.8 TB/s (both ways)
    Device("B200", r"B200", 178.4, 2250e12, 8000, 7200, 75e12),
    # A100 80GB SXM: 312 TFLOPS dense bf16, 2,039 GB/s, NVLink 600 GB/s (both ways)
    Device("A100-80GB", r"A100.*80", 79.2, 312e12, 2039, 2400, 19.5e12),
    # A100 40GB SXM: 312 TFLOPS, 1,555 GB/s, NVLink 600 GB/s
    Device("A100", r"A100", 39.4, 312e12, 1555, 2400, 19.5e12),
    # L40S: 362.05 TFLOPS dense, 864 GB/s, 48 GB, PCIe Gen4 64 GB/s (both ways)
    Device("L40S", r"L40S", 44.4, 362.05e12, 864, 256, 91.6e12),
    # A10: 125 TFLOPS dense, 600 GB/s, 24 GB, PCIe Gen4
    Device("A10", r"\bA10\b", 22.0, 125e12, 600, 256, 31.2e12),
    # L4: 242 TFLOPS sparse, 300 GB/s, 24 GB, PCIe Gen4
    Device("L4", r"\bL4\b", 22.0, 121e12, 300, 256, 30.3e12),
]
DEVICES = {d.name: d for d in _KNOWN}


def find_device(name: str) -> Device | None:
    """The device `name` names: one of DEVICES by name (any case), or a GPU's own name
    (torch.cuda.get_device_name(): "NVIDIA H100 80GB HBM3") by its pattern."""
    for d in _KNOWN:
        if d.name.lower() == name.strip().lower():
            return d
    for d in _KNOWN:
        if re.search(d.pattern, name, re.I):
            return d
    return None
