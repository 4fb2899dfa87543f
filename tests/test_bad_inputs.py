"""The catalog of bad inputs and faults (scripts/bad_inputs.py): every case one line on
stderr, the right exit code and nothing lost (end-to-end).  The config-only cases (exit 2
before any rank starts) run one after another in one worker process, through the function the
`composerun` script calls, with the same checks; a sample of them (`AS_TYPED_SAMPLE`) and every
case acted on before it has surely started (a signal at a fixed time, nohup's SIGHUP) run as a
user types them; the others fork from one process that has imported what a command imports
(`forked`), each child then the command as typed.

The cases of issue 17's "data or records lost" list, each in the catalog:
1. rotation deletes real checkpoints: k13 (a stray step-notes.txt and a step-* symlink, keep=1);
2. a failed command rewrites a good run's records: k24, k25, k04 (a finished run's directory
   is byte-for-byte as it was);
3. a finished run run again loses its results: k19 (byte-for-byte, exit 0), s04 (a finished
   sweep run again keeps its report's results), k04 (train.steps below the checkpoint: exit 2);
4. two runs in one run directory: e07 (refused, naming the holder), e08 (a dead run's lock is
   taken over);
5. SIGTERM/SIGUSR1 to the whole process group: g02, g03 (a checkpoint of the agreed step, exit
   75); nohup and SIGHUP: g05; the launcher SIGKILLed: g06 (the ranks stop, with a checkpoint);
6. checkpoint.resume=never over checkpoints: k14 (refused), k26 (start_over moves them aside);
7. a newest step folder that is a broken symlink: k09;
8. a hand-edited manifest: k10 (step), k11, k12 (world size).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e

_spec = importlib.util.spec_from_file_location("bad_inputs", REPO / "scripts" / "bad_inputs.py")
catalog = importlib.util.module_from_spec(_spec)
sys.modules["bad_inputs"] = catalog  # (dataclasses look their module up there)
_spec.loader.exec_module(catalog)  # type: ignore[union-attr]
CASES = catalog.cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case, two at a time (most of a case is a process starting)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    t0 = time.monotonic()
    done = catalog.run_catalog(CASES, root, jobs=2)
    print(f"\n{catalog.report(done)}\ncatalog: {time.monotonic() - t0:.0f} s")
    return {r.case.id: r for r in done}


def test_the_catalog_is_large_and_covers_every_family() -> None:
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
    families = {c.family for c in CASES}
    assert {"config", "mesh", "rules", "checkpoints", "data", "sweeps", "environment", "signals", "disk"} <= families


def test_the_cases_checked_in_one_process_are_config_only_and_a_sample_runs_as_typed() -> None:
    here = [c for c in CASES if catalog.checked_here(c)]
    assert here and all(c.code == 2 and c.act is None and not c.env and c.prog == "composerun" for c in here)
    sample = [c for c in CASES if c.id in catalog.AS_TYPED_SAMPLE]
    assert len(sample) == len(catalog.AS_TYPED_SAMPLE) and all(
        c.code == 2 and not catalog.checked_here(c) for c in sample
    )
    assert {"config", "mesh", "rules", "checkpoints", "data"} <= {c.family for c in sample}


def test_the_forked_cases_are_not_about_their_start_up() -> None:
    """A forked command is acted on, if at all, once it has started; the signals at a fixed
    time (while it imports, while its ranks start), nohup's and the sample run as typed;
    forked cases start ranks, sweeps and the checkpoint command."""
    forked = [c for c in CASES if catalog.forked(c)]
    assert all(c.prog != "nohup" and not catalog.checked_here(c) for c in forked)
    assert any("PYTHONPATH" in c.env for c in forked)  # a user's module, on the child's sys.path
    assert {c.act for c in forked if c.act} and all(c.act.after_start for c in forked if c.act)
    typed = {c.id for c in CASES if not catalog.forked(c) and not catalog.checked_here(c)}
    assert {"g05", "g08", "g09"} | catalog.AS_TYPED_SAMPLE <= typed
    assert {c.code for c in forked} >= {0, 1, 2} and {c.prog for c in forked} == {"composerun", "composerun-ckpt"}
    assert any("-m" in c.args for c in forked) and any(c.env for c in forked)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.id}-{c.what}" for c in CASES])
def test_case_holds(case, results: dict[str, Any]) -> None:
    r = results[case.id]
    if r.skipped:
        pytest.skip(r.skipped)
    assert not r.problems, f"{case.id} ({case.what}): {r.problems}"
