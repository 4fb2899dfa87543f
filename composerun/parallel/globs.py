"""The FQN globs rules and style maps select modules with: `*` one name, `**` any depth,
`{a,b}` either name, `<root>` the model itself."""

from __future__ import annotations

import re

ROOT = "<root>"


def glob_to_regex(glob: str) -> re.Pattern:
    if glob == ROOT:
        return re.compile(r"^$")
    out = ""
    for tok in re.split(r"(\*\*|\*|\{[^{}]*\})", glob):
        if tok.startswith("{") and tok.endswith("}"):  # {blocks,layers}: either name
            out += "(?:" + "|".join(re.escape(alt) for alt in tok[1:-1].split(",")) + ")"
        else:
            out += {"**": r".*", "*": r"[^.]+"}.get(tok, re.escape(tok))
    return re.compile(f"^{out}$")
