"""`composerun --help` (pure, and one end-to-end call): usage, examples, every group's options,
the companion commands, and a line on every key of the schema."""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from conftest import cli

from composerun import usage
from composerun.config import schema
from composerun.config.keys import KEYS


def schema_keys(cls: type = schema.Config, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, as a user types it (`checkpoint.async`, `sharding.rules[].api`)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        name, hint = ("async" if f.name == "async_" else f.name), hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += schema_keys(hint, f"{prefix}{name}.")
        elif typing.get_args(hint) and dataclasses.is_dataclass(typing.get_args(hint)[0]):  # list[RuleConfig]
            keys += schema_keys(typing.get_args(hint)[0], f"{prefix}{name}[].")
        else:
            keys.append(prefix + name)
    return keys


def test_every_key_has_a_line_and_every_line_a_key() -> None:
    keys = schema_keys()
    assert "sharding.rules[].api" in keys and "checkpoint.async" in keys
    assert sorted(set(keys) - set(KEYS)) == [], "keys without a line in composerun/config/keys.py"
    assert sorted(set(KEYS) - set(keys)) == [], "lines of composerun/config/keys.py for no key"
    assert all(line.strip() for line in KEYS.values())


def test_help_lists_groups_keys_and_companions() -> None:
    text = usage.text()
    assert text.startswith("usage: composerun +model=NAME")
    assert "_schema" not in text
    for group in ("model", "mesh", "sharding", "optim", "data", "checkpoint", "hydra/launcher"):
        for option in usage.options(group):
            assert option in text, f"{group}={option}"
    for key in KEYS:
        assert f"  {key} " in text
    for command in ("composerun-ckpt inspect", "composerun-ckpt export", "composerun-report", "composerun-tokenize"):
        assert command in text


def test_composerun_help_is_its_own(tmp_path: Path) -> None:
    r = cli("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == usage.text() + "\n" and r.stderr == ""
    r = cli("+model=unit", "-h", cwd=tmp_path)  # anywhere on the line
    assert r.stdout.startswith("usage: composerun") and not (tmp_path / "outputs").exists()


# `composerun ARGS` in a fresh interpreter, through the function the script calls; prints, last,
# whether torch was ever imported.
WITHOUT_TORCH = (
    "import atexit, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules)); "
    "import composerun; sys.argv = ['composerun', *sys.argv[1:]]; composerun.main()"
)


def test_help_and_a_config_error_answer_without_torch(tmp_path: Path) -> None:
    """Importing torch is most of a short command's time: --help, and a config that fails the
    schema's checks, answer before any module that imports it is loaded (launch/job.py imports
    the launcher's torch side once the config is good)."""
    for args, code in ((["--help"], 0), (["+model=unit", "train.steps=-1", "hydra.run.dir=run"], 2)):
        r = cli(*args, cwd=tmp_path, prog=[sys.executable, "-c", WITHOUT_TORCH])
        assert r.returncode == code, r.stderr
        assert r.stdout.splitlines()[-1] == "torch imported: False", args
    assert "train.steps=-1" in r.stderr and not (tmp_path / "run").exists()
