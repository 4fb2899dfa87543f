"""A pytest plugin of scripts/gpu_check.py (`-p gpu_check_pytest`): it keeps the tests that need
a CUDA GPU and deselects the others of the files collected.  A test needs one when it carries a
`skipif` whose reason names CUDA or a GPU (the suite's way of saying so:
`@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")`), or a marker
named `cuda` or `gpu`.  On a machine without one, the tests kept are collected and skip."""

from __future__ import annotations

import re

import pytest

NAMES_GPU = re.compile(r"\b(cuda|gpu)\b", re.I)


def needs_gpu(item: pytest.Item) -> bool:
    if any(NAMES_GPU.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif")):
        return True
    return any(item.get_closest_marker(name) is not None for name in ("cuda", "gpu"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [item for item in items if needs_gpu(item)]
    dropped = [item for item in items if not needs_gpu(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
