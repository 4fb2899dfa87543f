"""The device table (composerun/devices.py, issue 30's item 4): a GPU found by its exact name,
never by a neighbour's; the H100 variants; a device a user describes as a map in plan.device,
end to end in plan=true; and that map's bad inputs, one line each and exit 2 (also in
scripts/bad_inputs.py, c31 and c34-c37)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli, compose

from composerun.devices import DEVICES, find_device, plan_device
from composerun.errors import ConfigError
from composerun.parallel.planner import plan_offline

# torch.cuda.get_device_name() as GPUs print it, and the short names users type -> the entry
NAMES = {
    "NVIDIA H100 80GB HBM3": "H100", "H100": "H100", "H100-SXM": "H100", "h100 sxm": "H100",
    "NVIDIA H100 PCIe": "H100-PCIe", "H100-PCIe": "H100-PCIe", "H100_PCIE": "H100-PCIe",
    "NVIDIA H100 NVL": "H100-NVL", "H100-NVL": "H100-NVL",
    "H100-96GB": "H100-96GB", "H100-HBM2e": "H100-96GB",
    "NVIDIA H200": "H200", "H200": "H200", "H200-SXM": "H200",
    "NVIDIA H200 NVL": "H200-NVL", "H200-NVL": "H200-NVL",
    "NVIDIA GH200 480GB": "GH200", "GH200": "GH200",
    "NVIDIA GH200 144G HBM3e": "GH200-144GB", "GH200-144GB": "GH200-144GB",
    "NVIDIA B200": "B200", "B200": "B200",
    "NVIDIA A100-SXM4-80GB": "A100-80GB", "A100-80GB": "A100-80GB",
    "NVIDIA A100-SXM4-40GB": "A100", "A100": "A100", "A100-40GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100-PCIe-80GB", "A100-PCIe-80GB": "A100-PCIe-80GB",
    "NVIDIA A100-PCIE-40GB": "A100-PCIe", "A100-PCIe": "A100-PCIe",
    "NVIDIA L40S": "L40S", "L40S": "L40S", "NVIDIA A10": "A10", "A10": "A10", "NVIDIA L4": "L4", "L4": "L4",
}  # fmt: skip
# GPUs the table does not list, several one word from one it does
UNKNOWN = ["NVIDIA A10G", "NVIDIA L40", "NVIDIA H800", "NVIDIA H20", "NVIDIA A100X", "NVIDIA H100", "GH100", ""]
MAP = "{name: MyGPU, memory_gib: 80, bf16_tflops: 800, memory_gbs: 3000, link_gbps: 3600}"


def test_the_issues_three_wrong_matches() -> None:
    """A GH200 is not an H200; an A100 80GB PCIe has the PCIe card's bandwidth and link, not
    the SXM's; an L40S has nvidia-smi's 46068 MiB."""
    gh200, h200 = find_device("NVIDIA GH200 480GB"), find_device("NVIDIA H200")
    assert gh200.name == "GH200" and gh200.memory_gbs == 4000 and gh200.memory_gib == 95.6
    assert h200.memory_gbs == 4800 and find_device("GH200") is gh200
    pcie = find_device("NVIDIA A100 80GB PCIe")
    assert (pcie.name, pcie.memory_gbs, pcie.link_gbps) == ("A100-PCIe-80GB", 1935, 256)
    assert find_device("NVIDIA A100-SXM4-80GB").memory_gbs == 2039
    assert find_device("NVIDIA L40S").memory_gib == pytest.approx(46068 / 1024, abs=0.05)


def test_every_name_finds_its_entry_and_no_other() -> None:
    found = {n: getattr(find_device(n), "name", None) for n in NAMES}
    assert found == NAMES
    assert {find_device(n) for n in UNKNOWN} == {None}
    assert set(NAMES.values()) == set(DEVICES)  # every entry has a name here


def test_the_h100_variants_and_the_new_fields() -> None:
    """SXM, PCIe, NVL and torchtitan's 96 GB HBM2e part (its peak known within the NVL's and
    the SXM's: the midpoint, and the two as its range); fp8 peaks; the network per class."""
    sxm, pcie, nvl, hbm2e = (DEVICES[n] for n in ("H100", "H100-PCIe", "H100-NVL", "H100-96GB"))
    assert [d.memory_gbs for d in (sxm, pcie, nvl, hbm2e)] == [3350, 2000, 3900, 2400]
    assert hbm2e.bf16_flops_range == (nvl.bf16_flops, sxm.bf16_flops)
    assert hbm2e.bf16_flops == pytest.approx((nvl.bf16_flops + sxm.bf16_flops) / 2)
    assert (
        sxm.fp8_flops == pytest.approx(2 * sxm.bf16_flops, rel=1e-3)
        and DEVICES["A100"].fp8_flops == 0 == DEVICES["A10"].fp8_flops
    )
    assert (sxm.internode_gbps, hbm2e.internode_gbps, DEVICES["A100-80GB"].internode_gbps) == (400, 400, 200)
    assert all(d.fp32_flops < d.bf16_flops and d.link_gbps > 0 and d.internode_gbps > 0 for d in DEVICES.values())


def test_a_described_device_takes_the_rest_from_its_base() -> None:
    own = plan_device({"base": "H100", "memory_gib": 94, "internode_gbps": 200})
    assert (own.memory_gib, own.internode_gbps, own.bf16_flops, own.memory_gbs) == (94, 200, 989.4e12, 3350)
    assert plan_device({"base": "H100-96GB", "bf16_tflops": 900}).bf16_flops_range is None
    with pytest.raises(ConfigError, match=r"plan\.device\.memory_gbs: missing"):
        plan_device({"name": "X", "memory_gib": 80, "bf16_tflops": 800, "link_gbps": 3600})


def test_a_described_device_plans_in_process() -> None:
    e = plan_offline(compose("+model=transformer", "mesh=2", f"plan.device={MAP}"))[0]["estimate"]
    assert e["step_time"]["device"] == "MyGPU" and e["memory"]["limit_bytes"] == 80 * 2**30


@pytest.mark.e2e
def test_a_described_device_end_to_end(tmp_path: Path) -> None:
    """plan=true with plan.device a map, as a user types it: the estimate on that device, by its name."""
    r = cli("+model=transformer", "mesh=2", "plan=true", f"plan.device={MAP}", "hydra.run.dir=p", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fits in 80.0 GiB per rank" in r.stdout and "estimated step on MyGPU: " in r.stdout
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["estimate"]["step_time"]["device"] == "MyGPU"


# A bad device map (an unknown name or base, a key it does not take, a negative peak, a missing
# figure) is one line and exit 2 before anything is planned: the catalog's c31, c34-c37
# (scripts/bad_inputs.py).
