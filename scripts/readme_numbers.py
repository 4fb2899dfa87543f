"""The shown outputs of `plan=true` in README.md and docs/*.md, regenerated from the code that
prints them.

    python scripts/readme_numbers.py [--write]

A ```bash block of a page holding one `plan=true` command and followed by a ```text block is
a shown output: this runs the command (in a scratch folder) and prints its lines that the
page shows (the topology, the estimated peak, fits, the estimated step); with --write, puts
them in the page in place of the old ones.  tests/test_readme.py checks that every page's
lines are what the command prints now.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHOWN = ("topology: ", "estimated peak per rank: ", "fits in ", "does not fit in ", "estimated step on ")
BLOCK = re.compile(r"```bash\n([^`]*?plan=true[^`]*?)```\n\n```text\n(.*?)```", re.S)


def shown_outputs(text: str) -> list[tuple[str, str, tuple[int, int]]]:
    """(command, the text block's body, its span in the page) of every shown output of a page."""
    out = []
    for m in BLOCK.finditer(text):
        cmds = [c for c in m.group(1).splitlines() if c.strip() and not c.lstrip().startswith("#")]
        if len(cmds) == 1:
            out.append((cmds[0].split("  #", 1)[0].strip(), m.group(2), m.span(2)))
    return out


def printed(command: str) -> str:
    """The lines of SHOWN that `command` prints now, as a page shows them."""
    words = shlex.split(command)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "composerun", *words[1:], f"hydra.run.dir={tmp}/run"]
        r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if r.returncode:
        raise SystemExit(f"{command}: exit {r.returncode}: {r.stderr[-500:]}")
    return "".join(line + "\n" for line in r.stdout.splitlines() if line.startswith(SHOWN))


def pages() -> list[Path]:
    """The pages that may show an output: the README and every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="update the pages")
    args = ap.parse_args()
    for path in pages():
        text = path.read_text()
        for command, old, (start, end) in reversed(shown_outputs(text)):
            new = printed(command)
            name = path.relative_to(REPO)
            print(f"{name}: $ {command}  ({'unchanged' if new == old else 'changed'})\n{new}")
            text = text[:start] + new + text[end:]
        if args.write:
            path.write_text(text)


if __name__ == "__main__":
    main()
