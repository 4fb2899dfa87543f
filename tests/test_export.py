"""Export and init_from on real gloo ranks: each rank writes and reads only its own part.

One launch of 4 ranks (mesh 2x2) exports composite_param (10 rows: shards of 3, 3, 3 and 1
rows; a root parameter and a buffer) under FSDP over every rank, HSDP, replicate, and
the policy of issue 19 that puts the children on HSDP and the root on every rank, and
fusion_embedding_with_hook (a state-dict hook renames its key).  Every call that would
gather or scatter a whole tensor (DTensor.full_tensor/redistribute, torch's full state
dict utilities, dist.scatter/gather, distribute_tensor from a rank) raises on the ranks
while they export and load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose
from fixtures.export import export_and_init

from composerun.checkpoint.safetensors_io import Source, write_file
from composerun.config.schema import LaunchConfig, StartMethod
from composerun.launch.agent import start_ranks

MIXED = 'sharding.rules=[{match: "*", api: fully_shard, mesh_dims: [replicate, shard]}, {match: "<root>", api: fully_shard}]'
CASES = {
    "fsdp": ["+model=composite_param", "model.dim=10", "sharding=fsdp"],
    "hsdp": ["+model=composite_param", "model.dim=10", "sharding=hsdp"],
    "ddp": ["+model=composite_param", "model.dim=10", "sharding=ddp"],
    "mixed": ["+model=composite_param", "model.dim=10", MIXED],
    "hook": ["+model=fusion_embedding_with_hook", "sharding=fsdp"],
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("export")
    jobs = [(name, compose(*ov, "mesh=2x2", "checkpoint=none")) for name, ov in CASES.items()]
    lcfg = LaunchConfig(start_method=StartMethod.forkserver)
    return start_ranks(export_and_init, (jobs, str(root)), 4, root, lcfg)[0]


def _nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_export_is_the_full_state_dict_and_init_from_loads_it(exported: dict, case: str) -> None:
    """The file is the plain model's state_dict() under its own keys (safetensors' load_file
    opens it; format: pt), and a model initialised from it, or from the same tensors in two
    files and an index, holds exactly those values."""
    row = exported[case]
    want = row["want"]
    assert sorted(row["file"]) == sorted(want)
    assert row["metadata"] == {"step": "7", "format": "pt"}
    for key in want:
        assert torch.equal(row["file"][key], want[key]), key
        assert torch.equal(row["init"][key], want[key]), f"init_from: {key}"
        assert torch.equal(row["init_index"][key], want[key]), f"init_from an index: {key}"
    if case == "hook":
        assert "weight" in row["file"] and "embedding.weight" not in row["file"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fsdp", "hsdp", "mixed", "ddp"])
def test_each_rank_writes_and_reads_only_its_part(exported: dict, case: str) -> None:
    """The ranks write every byte of the file once between them, no rank more than its
    share; where a rank holds a shard of each tensor it reads only that shard's rows (under
    HSDP each replica reads its own); under replicate every rank holds, so reads, it all."""
    row = exported[case]
    total = _nbytes(row["want"])
    written, read = row["written"], row["read"]
    assert sum(written) == total, f"{case}: {written} written, the file holds {total} bytes"
    assert max(written) <= 0.6 * total, f"{case}: one rank wrote {max(written)} of {total} bytes"
    assert row["read_index"] == read
    if case == "ddp":
        assert read == [total] * 4
    elif case == "fsdp":  # the rows of every parameter once; the buffer, which every rank holds whole, on each
        buffer = row["want"]["buffer"].numel() * 4
        assert sum(read) == total + 3 * buffer and max(read) <= 0.4 * total, read
    else:  # the children's rows once per replica: each rank about half of them
        assert max(read) <= 0.6 * total, read


# --- the file format, in one process ------------------------------------------------------------

TENSORS = {
    "blocks.0.w": torch.arange(24, dtype=torch.float32).reshape(6, 4),
    "emb": torch.arange(10, dtype=torch.bfloat16),
    "ids": torch.arange(5, dtype=torch.int64),
    "empty": torch.zeros(0, 3),
    "flag": torch.tensor(True),
}


def test_a_file_written_in_pieces_is_save_files_byte_for_byte(tmp_path: Path) -> None:
    """The header first, then the tensors a batch at a time, each written into its place:
    the very bytes safetensors' save_file writes (its order of the data, its padding)."""
    from safetensors.torch import save_file

    save_file(TENSORS, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    batches = []

    def fill(keys: list[str]) -> dict[str, torch.Tensor]:
        batches.append(keys)
        return {k: TENSORS[k] for k in keys}

    specs = {k: (t.dtype, tuple(t.shape)) for k, t in TENSORS.items()}
    write_file(tmp_path / "ours.safetensors", specs, {"format": "pt"}, fill, batch_bytes=64)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert [k for b in batches for k in b] == list(TENSORS) and len(batches) > 1  # never the whole dict at once
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("layout", ["one file", "index", "torch file"])
def test_rows_are_read_alone_from_a_file_an_index_or_a_torch_file(tmp_path: Path, layout: str) -> None:
    import json

    from safetensors.torch import save_file

    if layout == "one file":
        path = tmp_path / "model.safetensors"
        save_file(TENSORS, str(path))
    elif layout == "index":
        path = tmp_path / "model.safetensors.index.json"
        parts = {"a.safetensors": ["blocks.0.w", "flag"], "b.safetensors": ["emb", "ids", "empty"]}
        for name, keys in parts.items():
            save_file({k: TENSORS[k] for k in keys}, str(tmp_path / name))
        path.write_text(json.dumps({"weight_map": {k: name for name, keys in parts.items() for k in keys}}))
    else:
        path = tmp_path / "model.pt"
        torch.save(TENSORS, path)
    src = Source(path, "checkpoint.init_from")
    assert src.shapes() == {k: tuple(t.shape) for k, t in TENSORS.items()}
    assert torch.equal(src.read("blocks.0.w", (2, 5)), TENSORS["blocks.0.w"][2:5])
    assert torch.equal(src.read("emb", (9, 10)), TENSORS["emb"][9:])
    assert torch.equal(src.read("flag"), TENSORS["flag"])


def test_the_launcher_checks_an_index_and_names_a_missing_part(tmp_path: Path) -> None:
    """checkpoint.init_from=model.safetensors.index.json is checked before any rank starts,
    from the headers of the files it names; a file it names that is gone is one line."""
    import json

    from safetensors.torch import save_file

    from composerun.errors import ConfigError
    from composerun.launch.preflight import check_init_from

    parts = {"a.safetensors": ["blocks.0.w", "flag"], "b.safetensors": ["emb", "ids", "empty"]}
    for name, keys in parts.items():
        save_file({k: TENSORS[k] for k in keys}, str(tmp_path / name))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: name for name, keys in parts.items() for k in keys}}))
    want = {k: tuple(t.shape) for k, t in TENSORS.items()}
    check_init_from(index, want)
    with pytest.raises(ConfigError, match=r"does not fit the model: missing keys \['extra'\]"):
        check_init_from(index, {**want, "extra": (1,)})
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"init_from=.*index.json: .*b.safetensors not a readable safetensors file"):
        check_init_from(index, want)
