"""The package's layout (pure): data flows one way, from the command line down, and no module
imports one above it; there is no import circle; no module grows past what a reader holds.

    command line (cli, checkpoint.cli: the entry points)
      -> launch/ report one job: checks, the run directory, starting ranks, signals, SLURM;
                        the sweep report
        -> train/       the run every rank makes: setup, step, loop, optimizer, metrics, verify
          -> parallel/ models/ data/ checkpoint/   mesh and rules, the models, data, checkpoints
            -> config/ console, errors, files, stopping, _torch_compat   schemas, errors, shared bits
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

PKG = REPO / "composerun"
# lower number: lower in the data flow; a module may import its own layer or lower ones only
LAYERS = {
    "config": 0, "console": 0, "errors": 0, "files": 0, "stopping": 0, "_torch_compat": 0, "devices": 0,
    "models": 1, "data": 1, "parallel": 1, "checkpoint": 1,
    "train": 2,
    "launch": 3, "report": 3,
    "cli": 4, "usage": 4, "checkpoint.cli": 4, "__main__": 4, "": 4,
}  # fmt: skip
MAX_LINES = 400
MAX_FUNCTION_LINES = {"train": 60, "": 90}  # the training loop's parts are shorter still


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def layer(module: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):  # the most specific first (checkpoint.cli)
        if module == prefix or module.startswith(prefix + ".") or prefix == "":
            return LAYERS[prefix]
    raise AssertionError(f"composerun.{module} belongs to no layer: add it to LAYERS")


def resolve(name: str, modules: set[str]) -> str | None:
    """The composerun module an import names (`from composerun.x import y` may name the
    module x.y or a name in x)."""
    if not name.startswith("composerun."):  # (every module imports the package itself: not an edge)
        return None
    name = name.removeprefix("composerun.")
    return name if name in modules else None


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every composerun module `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            m = resolve(n, modules)
            if m is not None:
                found.add(m)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) - {module_name(f)} for f in files}


def test_no_module_imports_one_above_it(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        f"composerun.{m or '__init__'} (layer {layer(m)}) imports composerun.{d} (layer {layer(d)})"
        for m, deps in graph.items()
        for d in deps
        if layer(d) > layer(m) and not d.startswith(m + ".")  # a package may name its own modules
    )
    assert not upward, "\n".join(upward)


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    """No module reaches itself through the modules it imports (packages' __init__ re-exports
    count as imports)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for d in sorted(graph.get(m, ())):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on_stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                d = stack.pop()
                on_stack.discard(d)
                component.append(d)
                if d == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


def test_every_module_holds_in_a_readers_mind() -> None:
    long = {
        str(f.relative_to(REPO)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_function_reads_at_once() -> None:
    long = []
    for f in PKG.rglob("*.py"):
        module = module_name(f)
        limit = next(n for prefix, n in MAX_FUNCTION_LINES.items() if module.startswith(prefix))
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > limit:
                    long.append(f"composerun.{module}.{node.name}: {n} lines (at most {limit})")
    assert not long, "\n".join(long)


def divides_the_batch(source: str) -> bool:
    """Whether code divides a batch by the replicas and micro-batches of a step (the
    micro-batch formula; evaluation's share per replica divides by the replicas alone, the
    loader's stride of a whole micro-batch by the micro-batches alone)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
            right = ast.unparse(node.right)
            if "batch" in ast.unparse(node.left) and "accum" in right and any(w in right for w in ("dp", "size", "replica")):
                return True
    return False


def test_the_micro_batch_formula_has_one_home() -> None:
    """The samples of one replica's forward are computed in config/values.py alone
    (micro_batch_of): the trainer, evaluation, the pre-flight, the plan's traces and the
    estimate all call it."""
    homes = sorted(str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if divides_the_batch(f.read_text()))
    assert homes == ["config/values.py"], homes
    # (and the check sees a second one: the trainer's old line)
    assert divides_the_batch("micro = self.batch // (self.dp.size * self.accum)")


def test_the_layout_test_would_catch_a_circle_and_an_upward_import(graph: dict[str, set[str]]) -> None:
    """The two checks above can fail: with an import planted from the bottom to the top."""
    planted = {m: set(d) for m, d in graph.items()}
    planted["errors"].add("cli")
    with pytest.raises(AssertionError, match="composerun.errors"):
        test_no_module_imports_one_above_it(planted)
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circle(planted)


def test_no_file_cites_a_document_the_repository_lacks() -> None:
    """The repository stands on its own: no tracked file points a reader to a document it does
    not ship (a list of pitfalls kept elsewhere, a folder beside the checkout), and every
    relative link of a Markdown file names a file that is here.  A fact a comment needs is
    said in the comment; a user's, in docs/."""
    import re
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    absent = re.compile(r"PIT[F]ALLS|\.\./shar[e]d/")  # (spelt so that this file does not match itself)
    cited = []
    for name in listed.stdout.split():
        path = REPO / name
        if not path.is_file() or path.suffix in {".json", ".jsonl", ".png", ".whl"}:
            continue
        text = path.read_text(errors="replace")
        cited += [f"{name}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1) if absent.search(line)]
        if path.suffix == ".md":
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
                if "://" not in target and not (path.parent / target).exists():
                    cited.append(f"{name}: links to {target}, which is not in the repository")
    assert not cited, "\n".join(cited)


# What decides where a run starts: picking a checkpoint (a run directory's newest, what a PATH
# names), recovering an unpublished save, and the decision that does both (checkpoint/start.py).
DECIDES_THE_START = {"choose", "recover", "candidate", "resolve_resume"}


def start_deciders(source: str) -> set[str]:
    """The calls in `source` that decide where a run starts: DECIDES_THE_START, and
    find_latest(..., strict=True) (the newest checkpoint a resume would take; the plain one
    is what a stopped run's line and `composerun-ckpt inspect` report)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in DECIDES_THE_START:
                found.add(name)
            elif name == "find_latest" and any(k.arg == "strict" for k in node.keywords):
                found.add("find_latest(strict)")
    return found


def test_where_a_run_starts_is_decided_once_before_any_rank() -> None:
    """checkpoint/start.py alone picks the checkpoint a run loads (and recovers, and applies
    the start-over rules), and the launching process (launch/job.py) alone calls it, once,
    before any rank starts; the ranks (train/, the Checkpointer) load the `Start` they are
    handed and never pick one themselves.  (folders.py's resolve_resume, what a PATH names,
    calls find_latest; recovery.py's recover calls candidate.)"""
    callers = {
        module_name(f): found for f in sorted(PKG.rglob("*.py")) if (found := start_deciders(f.read_text()))
    }
    assert callers == {
        "checkpoint.start": {"recover", "resolve_resume", "find_latest(strict)"},
        "checkpoint.folders": {"find_latest(strict)"},
        "checkpoint.recovery": {"candidate"},  # (recover's own)
        "launch.job": {"choose"},
    }, callers
    # (and the check sees a second decision: the ranks' old one in the Checkpointer)
    planted = "found = self._agree(lambda: find_latest(self.root, strict=True) if auto else resolve_resume(p))"
    assert start_deciders(planted) == {"find_latest(strict)", "resolve_resume"}
    assert start_deciders("recover(self.root)") == {"recover"}
