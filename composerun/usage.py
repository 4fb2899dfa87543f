"""`composerun --help`: what a person reads before the first run.

Hydra's own help lists every group's options with the schema's `_schema` among them and the
whole composed config, keys without a word on what they do.  This one says how to call
composerun, shows examples, lists the groups and their options as the files under
composerun/configs/ have them, explains every key in one line (config/keys.py), and names
the companion commands.  Hydra's flags stay behind `composerun --hydra-help`.
"""

from __future__ import annotations

from importlib.resources import files

from composerun.config.keys import KEYS

USAGE = """\
usage: composerun +model=NAME [GROUP=OPTION ...] [KEY=VALUE ...]
       composerun -m +model=A,B mesh=1,2 ...            a sweep: every combination, one report
       torchrun --nproc_per_node N -m composerun ...     under torchrun (or srun): it starts the ranks

Trains a model on a device mesh of ranks; the config chooses the model, the mesh, the sharding
policy and the checkpoints.  Run again with the same hydra.run.dir=DIR to resume.

examples:
  composerun +model=composite mesh=2x2 sharding=hsdp      4 ranks on this machine (HSDP on 2x2)
  composerun +model=transformer data=text mesh=2 sharding=fsdp_blocks_ac train.steps=50
  composerun +model=composite mesh=2 hydra.run.dir=runs/first     a run directory of your choice
  composerun +model=llama3_8b mesh=8x8 sharding=fsdp_blocks_ac plan=true plan.device=H100
                                                          plan only: memory and step time per rank
  composerun -m +model=unit,composite mesh=1,2,2x2 sharding=fsdp,hsdp
  composerun +model=unit --cfg job                        the composed config, every key and value
"""

GROUPS_NOTE = {
    "model": "(required: +model=NAME; or any class: +model=... model._target_=pkg.Class)",
    "mesh": "(or any shape: mesh=3x2; its product is the number of ranks)",
}

COMPANIONS = """\
companion commands (each with --help):
  composerun-ckpt inspect PATH          a checkpoint's manifest, integrity and entries (PATH: run dir,
                                        checkpoints/ or step-N)
  composerun-ckpt export PATH OUT       its model as one safetensors file (--format hf: a Hugging Face dir)
  composerun-report DIR                 a sweep's or run's summary.csv, summary.md and plots, rebuilt
  composerun-tokenize FILES --tokenizer T --out DIR
                                        text, JSONL or Parquet files into token shards for data=tokens
                                        (--chat: JSONL conversations, with a loss mask on the answers)

Hydra's own flags (--cfg, --info, -m, shell completion): composerun --hydra-help
"""


def options(group: str) -> list[str]:
    """The options of a config group: its YAML files (`_`-files are no options)."""
    folder = files("composerun.configs") / group
    names = [p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml")]
    return sorted(n for n in names if not n.startswith("_"))


def text() -> str:
    groups = ["model", "mesh", "sharding", "optim", "data", "checkpoint"]
    width = max(map(len, [*groups, "hydra/launcher"])) + 2
    lines = [USAGE, "config groups (GROUP=OPTION):"]
    for g in [*groups, "hydra/launcher"]:
        lines.append(_wrapped(f"  {g:<{width}}", ", ".join(options(g)) + " " + GROUPS_NOTE.get(g, "")))
    lines += [
        "",
        COMPANIONS,
        "keys (KEY=VALUE; sharding.rules.N.KEY sets rule N's; a group=OPTION first, then its keys):",
    ]
    width = max(map(len, KEYS)) + 2
    section = ""
    for key, what in KEYS.items():
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            lines.append("")
        lines.append(_wrapped(f"  {key:<{width}}", what))
    return "\n".join(lines)


def _wrapped(head: str, body: str, width: int = 110) -> str:
    """`head` then `body`'s words, the lines after the first indented as deep as `head`."""
    out, line, first = [], head, True
    for word in body.split():
        if len(line) + len(word) > width and not first:
            out.append(line.rstrip())
            line = " " * len(head)
        line += word + " "
        first = False
    out.append(line.rstrip())
    return "\n".join(out)
