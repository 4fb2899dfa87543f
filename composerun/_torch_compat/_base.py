"""The compat package's own tools: the torch versions it was checked against, and `_require`,
which fetches a private name of torch or fails with one clear error."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

TESTED = ((2, 13), (2, 14))  # [lower, upper) of torch versions this module was checked against


class ComposerunTorchCompatError(ImportError):
    pass


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _require(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ComposerunTorchCompatError(
            f"composerun needs {module}.{name}, which torch {torch.__version__} lacks "
            f"(tested with torch {TESTED[0][0]}.{TESTED[0][1]}): {e}"
        ) from None


if not (TESTED[0] <= _version() < TESTED[1]):
    warnings.warn(
        f"composerun was tested with torch {TESTED[0][0]}.{TESTED[0][1]}; found {torch.__version__}",
        stacklevel=2,
    )
