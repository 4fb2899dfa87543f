"""`composerun-ckpt inspect|export` on a real run's checkpoints (end-to-end tier).

One composerun run (composite, dim 16, mesh 2, a checkpoint every 2 steps) serves every
test.  Each `composerun-ckpt` subprocess pays torch's import (a few seconds on 2 cores),
so the tool runs as a subprocess where that is the point (the console script, the
environment, the one-line errors) and in-process through `main(argv)` elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import cli, cli_into_closed_pipe, latest_checkpoint

from composerun.checkpoint.cli import main
from composerun.models.reference import CompositeModel

pytestmark = pytest.mark.e2e

PROG = [str(Path(sys.executable).with_name("composerun-ckpt"))]
# what a launcher or torchrun would leave behind: the tool must need none of it
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("ckpt_cli")
    r = cli(
        "+model=composite",
        "model.dim=16",
        "mesh=2",
        "train.steps=4",
        "checkpoint.every=2",
        "hydra.run.dir=run",
        cwd=cwd,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return cwd / "run"


@pytest.fixture
def no_dist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)


def ckpt_tool(*args: str, cwd: Path):
    return cli(*args, cwd=cwd, prog=PROG, timeout=120)


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def model_keys() -> list[str]:
    return list(CompositeModel(16).state_dict())


def test_inspect_resolves_run_dir_checkpoints_dir_and_step_dir(run: Path, no_dist_env, capsys) -> None:
    step4 = latest_checkpoint(run)
    assert step4.name == "step-00000004"
    r = ckpt_tool("inspect", str(run), cwd=run.parent)  # the console script, no MASTER_ADDR
    assert r.returncode == 0, r.stderr
    assert "init_process_group" not in r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["checkpoint", str(step4)]
    assert ["step", "4"] in [ln.split() for ln in lines]
    assert ["integrity", "ok"] in [ln.split() for ln in lines]
    assert ["model.l1.weight", "16x16", "float32", "1024"] in [ln.split() for ln in lines]
    for top in ("model", "optim", "train", "rng"):
        assert any(ln.split()[:2] == ["total", top] for ln in lines), top

    step2 = run / "checkpoints" / "step-00000002"
    for path, resolved in ((run / "checkpoints", step4), (step4, step4), (step2, step2)):
        code, out, err = in_process(capsys, "inspect", str(path))
        assert code == 0, err
        assert out.splitlines()[0].split() == ["checkpoint", str(resolved)]


def test_inspect_json_lists_every_model_key(run: Path, capsys) -> None:
    code, out, err = in_process(capsys, "inspect", "--json", str(run))
    assert code == 0, err
    report = json.loads(out)
    assert report["step"] == 4 and report["model"] == "composite" and report["world_size"] == 2
    assert report["integrity"] == "ok" and report["ok"] is True
    want = model_keys()
    rows = {r["key"]: r for r in report["entries"]}
    assert [k[len("model.") :] for k in rows if k.startswith("model.")] == want
    assert rows["model.l1.weight"]["shape"] == [16, 16] and rows["model.l1.bias"]["dtype"] == "float32"
    sd = CompositeModel(16).state_dict()
    assert report["totals"]["model"] == {"entries": len(want), "bytes": sum(t.numel() * 4 for t in sd.values())}
    assert set(report["totals"]) == {"model", "optim", "train", "rng"}
    assert any(r["dtype"] == "bytes" and r["shape"] is None for r in report["entries"])  # optimizer param groups


def test_inspect_and_report_into_a_closed_pipe_are_no_error(run: Path, tmp_path: Path) -> None:
    """`composerun-ckpt inspect RUN | head`: exit 1 would say the checkpoint is damaged; and
    `composerun-report RUN | head` (on a copy: it writes its tables beside the run)."""
    rc, err = cli_into_closed_pipe("inspect", str(run), cwd=run.parent, prog=PROG)
    assert (rc, err) == (0, ""), err[-1500:]
    copy = shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints"))
    rc, err = cli_into_closed_pipe(
        str(copy), cwd=tmp_path, prog=[str(Path(sys.executable).with_name("composerun-report"))]
    )
    assert (rc, err) == (0, ""), err[-1500:]


def test_export_matches_dcp_and_loads_strictly(run: Path, tmp_path: Path, no_dist_env) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "out" / "model.safetensors"
    r = ckpt_tool("export", str(run), str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "init_process_group" not in r.stdout + r.stderr
    assert r.stdout.strip().startswith(f"{out}: 16 tensors, ")
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file (safetensors makes it 0600)

    model = CompositeModel(16)
    want = model.state_dict()
    with warnings.catch_warnings():  # DCP's single-process notice
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": want}, checkpoint_id=str(latest_checkpoint(run)))
    got = load_file(str(out))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    fresh = CompositeModel(16)
    fresh.load_state_dict(got)  # strict
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["step"] == "4"


def test_tampered_checkpoint(run: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "step-00000004"
    shutil.copytree(latest_checkpoint(run), bad)
    shard = sorted(bad.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    code, out, err = in_process(capsys, "inspect", str(bad))
    assert code == 1
    assert "checksum mismatch" in out and shard.name in out
    assert "model.l1.weight" in out  # what it found is still shown

    code, out, err = in_process(capsys, "inspect", "--json", str(bad))
    assert code == 1 and json.loads(out)["ok"] is False

    target = tmp_path / "t.safetensors"
    code, out, err = in_process(capsys, "export", str(bad), str(target))
    assert code == 1 and out == ""
    assert err.startswith("composerun-ckpt: error: ") and "checksum mismatch" in err
    assert len(err.strip().splitlines()) == 1
    assert not target.exists()


@pytest.mark.parametrize("case", ["missing", "empty", "not_safetensors"])
def test_bad_path_is_one_line_exit_2(run: Path, tmp_path: Path, case: str) -> None:
    (tmp_path / "empty").mkdir()
    args = {
        "missing": ["inspect", str(tmp_path / "nope")],
        "empty": ["export", str(tmp_path / "empty"), str(tmp_path / "m.safetensors")],
        "not_safetensors": ["export", str(run), str(tmp_path / "m.pt")],
    }[case]
    r = ckpt_tool(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("composerun-ckpt: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    if case == "not_safetensors":
        assert ".safetensors" in lines[0]


def test_no_process_group(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_dist_env, capsys) -> None:
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("composerun-ckpt started a process group")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setattr(dist, "TCPStore", refuse)
    assert in_process(capsys, "inspect", str(run))[0] == 0
    assert in_process(capsys, "export", str(run), str(tmp_path / "m.safetensors"))[0] == 0
    assert not dist.is_initialized()
