"""Pure tier: mixed precision as a policy resolves it, before any rank starts.

Lower-precision parameters reduce their gradients in float32 unless a reduce_dtype is given
(sharding-wide or on a rule), and the plan's options and byte counts say so; mixed precision
asked of a policy with no fully_shard/replicate rule (nothing would apply it) is one line.
(What FSDP really sends under these dtypes, against the plan: tests/test_policies.py.)"""

from __future__ import annotations

import pytest
from conftest import compose

from composerun.errors import ConfigError
from composerun.launch.preflight import check_policy, meta_model
from composerun.parallel.plan import format_table
from composerun.parallel.planner import plan_offline

COMPOSITE = ("+model=composite", "model.dim=16", "mesh=2", "plan.estimate=false")
LLAMA = ("+model=llama3_debug", "data=tokens", "mesh=2")


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


@pytest.mark.parametrize(
    "overrides",
    [
        (*LLAMA, "sharding=tp", "sharding.param_dtype=bfloat16"),
        (*LLAMA, "sharding=tp", "sharding.reduce_dtype=float32"),
        ("+model=composite", "sharding=none", "sharding.param_dtype=bfloat16"),
    ],
)
def test_mixed_precision_without_a_data_parallel_rule_is_refused(overrides: tuple[str, ...]) -> None:
    """Tensor parallelism alone (or no API) has no MixedPrecisionPolicy to give it to: it
    would train and communicate in fp32 while the config says bf16."""
    cfg = compose(*overrides)
    key = next(o.split("=")[0] for o in overrides if "_dtype=" in o)
    with pytest.raises(ConfigError, match=rf"^{key}=\w+: mixed precision is fully_shard's and replicate's, and "
                       rf"sharding={cfg.sharding.name} has neither.*or remove {key}$"):  # fmt: skip
        check_policy(cfg, meta_model(cfg))


def test_a_rule_level_dtype_on_tensor_parallelism_is_refused() -> None:
    cfg = compose(*LLAMA, "sharding=tp", "sharding.rules.0.param_dtype=bfloat16")
    with pytest.raises(
        ConfigError, match=r"param_dtype: an option of api fully_shard or replicate, not of parallelize"
    ):
        check_policy(cfg, meta_model(cfg))


def test_tensor_parallelism_with_fsdp_takes_bf16() -> None:
    cfg = compose(*LLAMA, "mesh=2x2", "sharding=fsdp_tp", "sharding.param_dtype=bfloat16")
    check_policy(cfg, meta_model(cfg))
