"""Accelerators composerun knows by name: their datasheet figures, for MFU (train/throughput.py)
and for the pre-flight estimate (`plan.device=H100`, parallel/estimate.py), and the device a
user describes instead (`plan.device='{base: H100, memory_gib: 94}'`).

Each figure is the vendor's datasheet value for the named part: dense (no sparsity) bf16 and
fp8 tensor-core FLOP/s (the datasheets' "with sparsity" figures halved; fp8 0 where the GPU has
no fp8 tensor cores), the fp32 (not TF32) peak for the products of an fp32 run, memory
bandwidth, the per-direction bandwidth of one GPU's link inside a node (NVLink, or PCIe where
it has none) and the per-GPU network bandwidth between nodes.  Memory is nvidia-smi's total
(MiB / 1024, as published probes print it); torch's `total_memory` reads a little less (an
A10: 22.06 of nvidia-smi's 22.49 GiB), which the estimate's reserve has to cover.

A GPU is found by its exact name: `torch.cuda.get_device_name()` ("NVIDIA H100 80GB HBM3")
or a short name a user types ("H100", "H100-PCIe"), compared without case, spaces, dashes or
underscores.  Names differ by one word between parts whose figures differ by 20 % or more
(an A100 80GB PCIe and an A100-SXM4-80GB; a GH200 and an H200), so a GPU this table does not
list is unknown (None: no MFU, no step time), never a neighbour's figures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from composerun.errors import ConfigError

GIB = 2**30
T = 1e12


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    bf16_flops: float  # dense bf16 peak, FLOP/s
    memory_gbs: float  # memory bandwidth, GB/s
    link_gbps: float  # one GPU's interconnect inside a node, per direction, Gbit/s
    fp32_flops: float  # fp32 (no TF32) peak, FLOP/s
    fp8_flops: float = 0.0  # dense fp8 peak, FLOP/s; 0: no fp8 tensor cores
    internode_gbps: float = 400.0  # one GPU's share of the network between nodes, Gbit/s
    # (low, high) where the peak is known only within bounds (bf16_flops is then their midpoint)
    bf16_flops_range: tuple[float, float] | None = None
    names: tuple[str, ...] = ()  # what it is called: get_device_name() strings and short names


# Network defaults (internode_gbps) are a node class's usual NICs, not a datasheet figure:
# HGX/DGX H100, H200 and B200 nodes have one 400 Gbit/s ConnectX-7 per GPU, a GH200 one
# 400 Gbit/s NIC per superchip, DGX A100 one 200 Gbit/s HDR NIC per GPU.  PCIe servers carry
# fewer NICs than GPUs: 200 Gbit/s per GPU for Hopper cards (a 400 Gbit/s NIC per pair), 100
# for Ampere and Ada cards.  plan.internode_gbps is where a cluster's own figure goes.
#
# Memory totals (nvidia-smi, MiB): modal-labs/modal-client#2797 lists H100 SXM 81559, A100
# 80GB 81920, A100 40GB 40960, A10 23028, L40S 46068, L4 23034; published nvidia-smi probes
# (H100 PCIe 81559, H100 NVL 95830, H200 and H200 NVL 143771, GH200 480GB 97871, GH200 144G
# HBM3e 146831, B200 183359, A100 80GB PCIe 81920, A100-PCIE-40GB 40960).
_KNOWN = [
    # H100 SXM datasheet: 1,979 TFLOPS bf16 and 3,958 fp8 sparse, 67 fp32, 3.35 TB/s, 80 GB,
    # NVLink 900 GB/s (both ways)
    Device("H100", 79.6, 989.4 * T, 3350, 3600, 67 * T, fp8_flops=1979 * T, internode_gbps=400,
           names=("NVIDIA H100 80GB HBM3", "H100", "H100-SXM", "H100-SXM5", "H100-SXM-80GB")),
    # H100 PCIe: 1,513 bf16 and 3,026 fp8 sparse, 51 fp32, 2 TB/s, 80 GB; PCIe Gen5 128 GB/s
    # (both ways: a pair's NVLink bridge does not reach the rest of the node)
    Device("H100-PCIe", 79.6, 756.5 * T, 2000, 512, 51 * T, fp8_flops=1513 * T, internode_gbps=200,
           names=("NVIDIA H100 PCIe", "H100-PCIe")),
    # H100 NVL: 1,671 bf16 and 3,341 fp8 sparse, 60 fp32, 3.9 TB/s, 94 GB, NVLink bridge 600 GB/s
    Device("H100-NVL", 93.6, 835.5 * T, 3900, 2400, 60 * T, fp8_flops=1670.5 * T, internode_gbps=200,
           names=("NVIDIA H100 NVL", "H100-NVL", "H100-94GB")),
    # H100 SXM with 96 GB HBM2e at a 500 W limit (the part torchtitan's published Llama 3.1
    # tables ran on, 8 a node, NVLink, 400 Gbit/s per GPU between nodes): 2.4 TB/s; its
    # authors put its peak between the NVL's and the SXM's, exact value unknown: the midpoint
    # here, the two as its range.  Its nvidia-smi total is not published: a GH200's 96 GB.
    Device("H100-96GB", 95.6, 912.45 * T, 2400, 3600, 63.5 * T, fp8_flops=1824.75 * T, internode_gbps=400,
           bf16_flops_range=(835.5 * T, 989.4 * T), names=("H100-96GB", "H100-HBM2e", "H100-SXM-96GB")),
    # H200 SXM: 1,979 bf16 and 3,958 fp8 sparse, 67 fp32, 4.8 TB/s, 141 GB, NVLink 900 GB/s
    Device("H200", 140.4, 989.4 * T, 4800, 3600, 67 * T, fp8_flops=1979 * T, internode_gbps=400,
           names=("NVIDIA H200", "H200", "H200-SXM", "H200-141GB")),
    # H200 NVL: 1,671 bf16 and 3,341 fp8 sparse, 60 fp32, 4.8 TB/s, 141 GB, NVLink bridge 900 GB/s
    Device("H200-NVL", 140.4, 835.5 * T, 4800, 3600, 60 * T, fp8_flops=1670.5 * T, internode_gbps=200,
           names=("NVIDIA H200 NVL", "H200-NVL")),
    # GH200 Grace Hopper datasheet, its H100-class GPU: 1,979 bf16 and 3,958 fp8 sparse, 67 fp32;
    # 96 GB HBM3 at 4 TB/s; NVLink 900 GB/s between superchips (NVL2, NVL32: a node of one
    # superchip has no peer, and its collectives cross the network)
    Device("GH200", 95.6, 989.4 * T, 4000, 3600, 67 * T, fp8_flops=1979 * T, internode_gbps=400,
           names=("NVIDIA GH200 480GB", "GH200", "GH200-96GB", "GH200-480GB")),
    # GH200 with 144 GB HBM3e at 4.9 TB/s; the same GPU
    Device("GH200-144GB", 143.4, 989.4 * T, 4900, 3600, 67 * T, fp8_flops=1979 * T, internode_gbps=400,
           names=("NVIDIA GH200 144G HBM3e", "GH200-144GB", "GH200-HBM3e")),
    # HGX B200, per GPU: 4.5 PFLOPS bf16 and 9 fp8 sparse, 75 TFLOPS fp32, 8 TB/s, 180 GB,
    # NVLink 5 1.8 TB/s (both ways)
    Device("B200", 179.1, 2250 * T, 8000, 7200, 75 * T, fp8_flops=4500 * T, internode_gbps=400,
           names=("NVIDIA B200", "B200")),
    # A100 80GB SXM: 312 TFLOPS dense bf16, 19.5 fp32, no fp8, 2,039 GB/s, NVLink 600 GB/s (both ways)
    Device("A100-80GB", 80.0, 312 * T, 2039, 2400, 19.5 * T, internode_gbps=200,
           names=("NVIDIA A100-SXM4-80GB", "A100-80GB", "A100-SXM-80GB")),
    # A100 40GB SXM: 312 TFLOPS, 1,555 GB/s, NVLink 600 GB/s
    Device("A100", 40.0, 312 * T, 1555, 2400, 19.5 * T, internode_gbps=200,
           names=("NVIDIA A100-SXM4-40GB", "A100", "A100-40GB", "A100-SXM-40GB")),
    # A100 80GB PCIe: 312 TFLOPS, 1,935 GB/s; PCIe Gen4 64 GB/s (both ways; a bridge joins a pair only)
    Device("A100-PCIe-80GB", 80.0, 312 * T, 1935, 256, 19.5 * T, internode_gbps=100,
           names=("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB", "A100-80GB-PCIe")),
    # A100 40GB PCIe: 312 TFLOPS, 1,555 GB/s, PCIe Gen4
    Device("A100-PCIe", 40.0, 312 * T, 1555, 256, 19.5 * T, internode_gbps=100,
           names=("NVIDIA A100-PCIE-40GB", "A100-PCIe", "A100-PCIe-40GB", "A100-40GB-PCIe")),
    # L40S: 362.05 TFLOPS dense bf16, 1,466 fp8 sparse, 91.6 fp32, 864 GB/s, 48 GB, PCIe Gen4 64 GB/s
    Device("L40S", 45.0, 362.05 * T, 864, 256, 91.6 * T, fp8_flops=733 * T, internode_gbps=100,
           names=("NVIDIA L40S", "L40S")),
    # A10: 125 TFLOPS dense bf16, 31.2 fp32, no fp8, 600 GB/s, 24 GB, PCIe Gen4 (the A10G is another part)
    Device("A10", 22.5, 125 * T, 600, 256, 31.2 * T, internode_gbps=100, names=("NVIDIA A10", "A10")),
    # L4: 242 TFLOPS bf16 and 485 fp8 sparse, 30.3 fp32, 300 GB/s, 24 GB, PCIe Gen4
    Device("L4", 22.5, 121 * T, 300, 256, 30.3 * T, fp8_flops=242.5 * T, internode_gbps=100,
           names=("NVIDIA L4", "L4")),
]  # fmt: skip
DEVICES = {d.name: d for d in _KNOWN}


def _key(name: str) -> str:
    """A name as the table compares it: no case, spaces, dashes or underscores."""
    return re.sub(r"[\s_-]+", "", name).lower()


_BY_NAME: dict[str, Device] = {}
for _d in _KNOWN:
    for _n in (_d.name, *_d.names):
        assert _BY_NAME.setdefault(_key(_n), _d) is _d, f"{_n} names two devices"


def find_device(name: str) -> Device | None:
    """The device `name` names exactly (the module's docstring), or None."""
    return _BY_NAME.get(_key(name))


# plan.device as a map: its keys, in the units people quote, and the Device field each sets.
_MAP_KEYS = {
    "memory_gib": ("memory_gib", 1.0, "GiB"),
    "bf16_tflops": ("bf16_flops", T, "TFLOP/s, dense"),
    "memory_gbs": ("memory_gbs", 1.0, "GB/s"),
    "link_gbps": ("link_gbps", 1.0, "Gbit/s per direction, inside a node"),
    "fp32_tflops": ("fp32_flops", T, "TFLOP/s"),
    "fp8_tflops": ("fp8_flops", T, "TFLOP/s, dense; 0: none"),
    "internode_gbps": ("internode_gbps", 1.0, "Gbit/s per GPU, between nodes"),
}
_REQUIRED = ("memory_gib", "bf16_tflops", "memory_gbs", "link_gbps")  # without a base


def known_names() -> str:
    return ", ".join(DEVICES)


def plan_device(value: Any, key: str = "plan.device") -> Device:
    """The device `plan.device` gives: a known name, or a map of figures (the module's
    docstring) whose missing keys come from `base`; a ConfigError naming the key otherwise."""
    if isinstance(value, str):
        found = find_device(value)
        if found is None and key == "plan.device":
            raise ConfigError(
                f"{key}={value}: composerun knows {known_names()}; or describe it: "
                f"{key}='{{base: H100, memory_gib: 94}}', or give plan.memory_gib"
            )
        if found is None:
            raise ConfigError(f"{key}={value}: composerun knows {known_names()}")
        return found
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}={value}: a device's name ({known_names()}) or a map of its figures")
    return _described(dict(value), key)


def _described(given: dict[str, Any], key: str) -> Device:
    """A device from a map of figures (plan_device)."""
    unknown = sorted(set(given) - {"name", "base", *_MAP_KEYS})
    if unknown:
        keys = ", ".join(["name", "base", *_MAP_KEYS])
        raise ConfigError(f"{key}.{unknown[0]}: no such key in a device map; it takes {keys}")
    base = plan_device(str(given["base"]), f"{key}.base") if given.get("base") is not None else None
    if base is None:
        missing = [k for k in _REQUIRED if given.get(k) is None]
        if missing:
            raise ConfigError(
                f"{key}.{missing[0]}: missing ({_MAP_KEYS[missing[0]][2]}); a map without base names "
                f"{', '.join(_REQUIRED)}, or give base: H100 to take the rest from a known device"
            )
    fields: dict[str, Any] = {}
    for name, value in given.items():
        if name in ("name", "base") or value is None:
            continue
        field, scale, unit = _MAP_KEYS[name]
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        least = 0 if name == "fp8_tflops" else None
        if number is None or not math.isfinite(number) or not (number > 0 or number == least):
            must = "0 or more" if least == 0 else "a positive number"
            raise ConfigError(f"{key}.{name}={value}: must be {must} ({unit})")
        fields[field] = float(number) * scale
    name = str(given.get("name") or (f"{base.name} (described)" if base else "described"))
    if base is None:  # (no base: an fp32 peak of 1/16 the bf16 one, as on an A100, unless given)
        fields.setdefault("fp32_flops", fields["bf16_flops"] / 16)
        return Device(name=name, **fields)
    if "bf16_flops" in fields:
        fields["bf16_flops_range"] = None  # (the base's bounds are of its own peak)
    return replace(base, name=name, names=(), **fields)
