"""Pure tier: mixed precision as a policy resolves it, before any rank starts.

Lower-precision parameters reduce their gradients in float32 unless a reduce_dtype is given
(sharding-wide or on a rule), and the plan's options and byte counts say so.
(What FSDP really sends under these dtypes, against the plan: tests/test_policies.py.)"""

from __future__ import annotations

from conftest import compose

from composerun.parallel.plan import format_table
from composerun.parallel.planner import plan_offline

COMPOSITE = ("+model=composite", "model.dim=16", "mesh=2", "plan.estimate=false")


def planned(*overrides: str) -> dict:
    return plan_offline(compose(*COMPOSITE, *overrides))[0]


def test_bf16_parameters_reduce_in_fp32_unless_a_reduce_dtype_is_given() -> None:
    fp32 = planned()["comm_per_step"]
    cases = {
        ("sharding.param_dtype=bfloat16",): "float32",
        ("sharding.param_dtype=float16",): "float32",
        ("sharding.param_dtype=bfloat16", "sharding.reduce_dtype=bfloat16"): "bfloat16",
        ("sharding.param_dtype=bfloat16", "sharding.rules.0.reduce_dtype=bfloat16"): "rule 0 bfloat16",
    }
    for overrides, want in cases.items():
        report = planned(*overrides)
        reduces = {u["options"]["reduce_dtype"] for u in report["units"]}
        comm = report["comm_per_step"]
        assert comm["all_gather"] == fp32["all_gather"] // 2, overrides
        if want == "float32":
            assert reduces == {"float32"} and comm["reduce_scatter"] == fp32["reduce_scatter"], overrides
        elif want == "bfloat16":
            assert reduces == {"bfloat16"} and comm["reduce_scatter"] == fp32["reduce_scatter"] // 2, overrides
        else:  # the rule's own dtype wins over the default for its units only (the root's: no parameters)
            by_unit = {u["fqn"]: u["options"]["reduce_dtype"] for u in report["units"]}
            assert by_unit.pop("<root>") == "float32" and set(by_unit.values()) == {"bfloat16"}, overrides
            assert comm["reduce_scatter"] == fp32["reduce_scatter"] // 2, overrides
    # shown in the plan's table beside the parameters' dtype
    assert "param_dtype=bfloat16,reduce_dtype=float32" in format_table(planned("sharding.param_dtype=bfloat16"))


def test_a_rules_own_bf16_parameters_reduce_in_fp32() -> None:
    report = planned("sharding.rules.0.param_dtype=bfloat16")
    options = {u["fqn"]: u["options"] for u in report["units"]}
    assert options.pop("<root>") == {}  # the root's rule sets nothing: fp32 throughout
    assert options and all(o == {"param_dtype": "bfloat16", "reduce_dtype": "float32"} for o in options.values())


def test_fp32_parameters_set_no_reduce_dtype() -> None:
    report = planned("sharding.param_dtype=float32")
    assert {tuple(sorted(u["options"].items())) for u in report["units"]} == {(("param_dtype", "float32"),)}
