"""The package's layout (pure): data flows one way, from the command line down, and no module
imports one above it; there is no import circle; no module grows past what a reader holds.

    command line (cli, checkpoint.cli: the entry points)
      -> launch/ report one job: checks, the run directory, starting ranks, signals, SLURM;
                        the sweep report
        -> train/       the run every rank makes: setup, step, loop, optimizer, metrics, verify
          -> parallel/ models/ data/ checkpoint/   mesh and rules, the models, data, checkpoints
            -> config/ console, errors, rundir, stopping, _torch_compat   schemas, errors, shared bits

and one module (rundir.py) names every file of a run directory and alone writes summary.json.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

PKG = REPO / "composerun"
# lower number: lower in the data flow; a module may import its own layer or lower ones only
LAYERS = {
    "config": 0, "console": 0, "errors": 0, "rundir": 0, "stopping": 0, "_torch_compat": 0, "devices": 0,
    "models": 1, "data": 1, "parallel": 1, "checkpoint": 1,
    "train": 2,
    "launch": 3, "report": 3, "profile_report": 3,
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


# The one module that names a run directory's files and reads and writes its summary.json
RUN_DIR_OWNER = "rundir"
# Every name under a run directory, spelt as the run writes them ("{}": a number).  Each is a
# file's or folder's name wherever code spells it; "export" and "tb" are also summary.json's
# and the command line's words, so those count only where they are a part of a path.
RUN_DIR_NAMES = (
    "summary.json", "metrics.jsonl", "plan.json", ".hydra", "hydra.yaml", "overrides.yaml", "checkpoints",
    "torchelastic", ".composerun.lock", "composerun.log", "rank{}.log", "replaced-{}",
)  # fmt: skip
RUN_DIR_PATH_WORDS = ("export", "tb")


def _strings(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every string the code spells (an f-string with "{}" for each value it formats), with
    its node; docstrings are prose, not paths, and are left out."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    inner = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            found.append((node, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs | inner:
            found.append((node, node.value))
    return found


def names_run_dir_files(source: str) -> list[str]:
    """The run-directory names `source` spells as a path (not in a docstring or a sentence)."""
    tree = ast.parse(source)
    path_parts = {
        id(side) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
        for side in (node.left, node.right)
    } | {
        id(arg) for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("Path", "joinpath", "glob", "rglob")
        for arg in node.args
    }  # fmt: skip
    named = []
    for node, text in _strings(tree):
        head = text.split("/")[0]
        if head.startswith("replaced-"):
            head = "replaced-{}"
        if head in RUN_DIR_NAMES or (head in RUN_DIR_PATH_WORDS and (id(node) in path_parts or "/" in text)):
            named.append(text)
    return named


def writes_a_summary(source: str) -> list[str]:
    """Calls in `source` that write a summary's file by another way than the owner's writer:
    write_json (or a write_text/write_bytes) on a path that says "summary", and any use of the
    owner's private names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            target = ast.unparse(node.args[0]) if func.split(".")[-1] == "write_json" and node.args else None
            if func.split(".")[-1] in ("write_text", "write_bytes"):
                target = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else None
            # (a sweep's summary.md and summary.csv are the report's, in the sweep directory)
            if target is not None and "summary" in re.sub(r"summary\.(md|csv)", "", target.lower()):
                found.append(ast.unparse(node))
        if isinstance(node, ast.ImportFrom) and node.module == f"composerun.{RUN_DIR_OWNER}":
            found += [f"imports {a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_SUMMARY"):
            found.append(ast.unparse(node))
    return found


def test_summary_json_has_one_writer() -> None:
    """summary.json, which the launcher, the ranks and the reports all read, is spelt, read and
    written in composerun/rundir.py alone (RunDir.read_summary, RunDir.write_summary)."""
    spelt, written = [], []
    for f in sorted(PKG.rglob("*.py")):
        if module_name(f) == RUN_DIR_OWNER:
            continue
        source = f.read_text()
        spelt += [f"{f.relative_to(PKG)}: {t!r}" for t in names_run_dir_files(source) if "summary" in t]
        written += [f"{f.relative_to(PKG)}: {c}" for c in writes_a_summary(source)]
    assert not spelt, "summary.json named outside rundir.py:\n" + "\n".join(spelt)
    assert not written, "summary.json written outside RunDir.write_summary:\n" + "\n".join(written)


def test_no_module_but_the_owner_names_run_directory_files() -> None:
    named = [
        f"{f.relative_to(PKG)}: {t!r}"
        for f in sorted(PKG.rglob("*.py"))
        if module_name(f) != RUN_DIR_OWNER
        for t in names_run_dir_files(f.read_text())
    ]
    assert not named, "run-directory names outside rundir.py (ask RunDir for the path):\n" + "\n".join(named)
    # the owner spells each of them: the list above is the run directory's, not a stale one
    # (composerun.log, Hydra's own, only in the pattern of what a start leaves)
    owner = names_run_dir_files((PKG / f"{RUN_DIR_OWNER}.py").read_text())
    heads = {"replaced-{}" if t.startswith("replaced-") else t.split("/")[0] for t in owner}
    assert set(RUN_DIR_NAMES) - {"composerun.log"} <= heads, sorted(set(RUN_DIR_NAMES) - heads)


def test_the_run_directory_checks_see_what_they_look_for() -> None:
    """The two checks above can fail: each spelling the code had before rundir.py is caught,
    and words that are not paths (a summary's key, a sentence, a docstring) are not."""
    planted = {
        'write_json(run_dir / "summary.json", summary)': ("summary.json", 1),
        "write_json(self.summary_path, {**s, 'job_wall_s': 1.0})": (None, 1),
        'root = run_dir / "checkpoints"': ("checkpoints", 0),
        'export_hf(model, cfg, s.run_dir / "export" / "hf", shard)': ("export", 0),
        'h = logging.FileHandler(run_dir / f"rank{rank}.log")': ("rank{}.log", 0),
        'dest = run_dir / f"replaced-{stamp}"': ("replaced-{}", 0),
        'names = (".hydra/config.yaml", ".hydra/hydra.yaml")': (".hydra/config.yaml", 0),
        "from composerun.rundir import _SUMMARY": (None, 1),
        'p.write_text(json.dumps(summary)) if (p := run_dir / "x") else None': (None, 0),
        'summary_file.write_text("{}")': (None, 1),
    }
    for line, (name, writes) in planted.items():
        named = names_run_dir_files(line)
        assert (name in named) if name else not named, (line, named)
        assert len(writes_a_summary(line)) == writes, (line, writes_a_summary(line))
    innocent = (
        'done = summary.get("export")\n'
        'sub.add_parser("export")\n'
        'msg = f"plan=true writes plan.json and summary.json, but {run_dir} holds a run"\n'
        'def f():\n    """Writes summary.json and checkpoints/."""\n'
    )
    assert not names_run_dir_files(innocent) and not writes_a_summary(innocent)


def test_the_layout_test_would_catch_a_circle_and_an_upward_import(graph: dict[str, set[str]]) -> None:
    """The two checks above can fail: with an import planted from the bottom to the top."""
    planted = {m: set(d) for m, d in graph.items()}
    planted["errors"].add("cli")
    with pytest.raises(AssertionError, match="composerun.errors"):
        test_no_module_imports_one_above_it(planted)
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circle(planted)


def doors_into_the_run(source: str) -> list[str]:
    """The functions of a module (`<module>`: its top) that import train/run.py's `run`, the
    run every rank makes, or that module itself."""
    doors: list[str] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and child.level == 0:
                names = {a.name for a in child.names}
                if (child.module == "composerun.train.run" and "run" in names) or (
                    child.module == "composerun.train" and "run" in names
                ):
                    doors.append(where)
            elif isinstance(child, ast.Import) and any(a.name == "composerun.train.run" for a in child.names):
                doors.append(where)
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return doors


def test_one_door_into_a_ranks_run() -> None:
    """Every way a rank starts (torchrun, composerun's agent, the one rank in the launching
    process) enters its run through launch/rank.py's run_rank, which sets up its logs and its
    error reporting: no other function reaches train/run.py's `run`."""
    doors = sorted(f"{module_name(f)}.{fn}" for f in PKG.rglob("*.py") for fn in doors_into_the_run(f.read_text()))
    assert doors == ["launch.rank.run_rank"], doors
    # (and the check sees a second door: the one the in-process rank had)
    planted = "def launch(cfg, run_dir):\n    from composerun.train.run import run\n\n    return run(cfg, run_dir)\n"
    assert doors_into_the_run(planted) == ["launch"]
    assert doors_into_the_run("from composerun.train import run\n") == ["<module>"]


def writes_to_imported_state(source: str) -> list[str]:
    """Each `x.attr = ...` (or `+=`, `del`) whose `x` is a name the module imported from
    composerun: one module setting the state of another (its module globals, a class's
    attributes) instead of handing it a value."""
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("composerun"):
            imported |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("composerun")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    base = sub.value
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    if isinstance(base, ast.Name) and base.id in imported:
                        found.append(f"line {node.lineno}: {ast.unparse(sub)}")
    return found


def test_no_module_sets_another_modules_state() -> None:
    """Values are passed, not left in another module's globals or class attributes for it to
    find (the command line once set the job's command as a global of launch/job.py, and two
    modules wrote the sweep report's class attributes)."""
    writes = [
        f"composerun/{f.relative_to(PKG)}: {w}"
        for f in PKG.rglob("*.py")
        for w in writes_to_imported_state(f.read_text())
    ]
    assert not writes, "\n".join(writes)
    # (and the check sees both of those)
    assert writes_to_imported_state("from composerun.launch import job\n\njob.command = 'composerun'\n")
    planted = "def f():\n    from composerun.report import SweepReport\n\n    SweepReport.wrote = True\n"
    assert writes_to_imported_state(planted) == ["line 4: SweepReport.wrote"]


def test_no_file_cites_a_document_the_repository_lacks() -> None:
    """The repository stands on its own: no tracked file points a reader to a document it does
    not ship (a list of pitfalls kept elsewhere, a folder beside the checkout), and every
    relative link of a Markdown file names a file that is here.  A fact a comment needs is
    said in the comment; a user's, in docs/."""
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
    calls find_latest; recovery.py's recover calls candidate; start.py's `restarted` calls
    choose for rank 0 of ranks that torch's agents started again, whose launcher is not asked
    again: an elastic run that lost a node.)"""
    callers = {
        module_name(f): found for f in sorted(PKG.rglob("*.py")) if (found := start_deciders(f.read_text()))
    }
    assert callers == {
        "checkpoint.start": {"recover", "resolve_resume", "find_latest(strict)", "choose"},
        "checkpoint.folders": {"find_latest(strict)"},
        "checkpoint.recovery": {"candidate"},  # (recover's own)
        "launch.job": {"choose"},
    }, callers
    # (and the check sees a second decision: the ranks' old one in the Checkpointer)
    planted = "found = self._agree(lambda: find_latest(self.root, strict=True) if auto else resolve_resume(p))"
    assert start_deciders(planted) == {"find_latest(strict)", "resolve_resume"}
    assert start_deciders("recover(self.root)") == {"recover"}
