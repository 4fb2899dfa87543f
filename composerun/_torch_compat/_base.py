"""The compat package's own tools: the torch versions it was checked against, and `_require`,
which fetches a private name of torch or fails with one clear error."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

# [lower, upper) of the torch releases this package was checked against, name by name: CI runs
# the suite on 2.13 and the compat tier on 2.14; 2.11 (what GPU images ship) and 2.12 were read,
# and 2.11 passed the compat tier on a CPU; tests/test_torch_versions.py simulates what 2.11 does
# differently.  pyproject.toml's torch requirement is the same range (a test says so).
TESTED = ((2, 11), (2, 15))


class ComposerunTorchCompatError(ImportError):
    pass


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def tested() -> str:
    """The tested releases, as an error message says them: `2.11 to 2.14`."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor - 1}"


def _require(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ComposerunTorchCompatError(
            f"composerun needs {module}.{name}, which torch {torch.__version__} lacks "
            f"(tested with torch {tested()}): {e}"
        ) from None


if not (TESTED[0] <= _version() < TESTED[1]):
    warnings.warn(f"composerun was tested with torch {tested()}; found {torch.__version__}", stacklevel=2)
