"""DCP checkpoints under <run>/checkpoints/step-NNNNNNNN/, published atomically.

A checkpoint is a flat dict of Stateful objects under fixed keys: `model` (FQN-keyed like
the unsharded model's state_dict()), `optim` (FQN-keyed), `train` (step and samples seen:
the data position; the LR schedule is a function of the step) and `rng` (each rank's RNG
state under its own key, `rng.rank<R>`, since DCP keeps only one copy of a key that every
rank saves, from whichever rank it picks).  It is plain DCP: torch alone can load its
`model` entry.

Publishing (DCP writes its files in place, so a crash mid-save into a used folder would leave
one that mixes two saves): every rank writes into a fresh `step-N.tmp-<id>` folder
(overwrite=False), all ranks confirm, rank 0 writes `manifest.json` (step, config hash,
mesh, plan, torch version, size and checksum of every file), renames the folder to `step-N`
and then replaces `checkpoints/latest`.  A crash at any point leaves `latest` on the previous
complete checkpoint.  Each rank records its files' sizes and checksums in the tmp folder once
they are synced, so the next start publishes a save every rank had written (recovery.py,
before any rank starts) once its files match; any other leftover tmp folder is removed,
never resumed from.

Checksums (`checkpoint.checksum`: xxh3_128 by default, or sha256) are computed while DCP
writes each file, by the rank that writes it (writer.py, which also leaves out
torch.save's redundant CRC32s and writes the files with plain buffered writes, through a
page cache of bounded size with `checkpoint.bounded_cache`, or with `checkpoint.direct_io`
O_DIRECT), so a save never reads its files
back; a resume checks them as it loads, each rank its share of the files.

Async saves (`checkpoint.async=true`) stage the state (a copy into buffers allocated once
and reused, ordered after the optimizer step on a GPU: staging.py) in a background thread
too, while the next step's forward and backward run; training waits for the copy only before its optimizer updates the
weights (`wait_staged`).  DCP's writes then run in another background thread on a process
group of their own (on a shared one, the thread's collectives and training's would meet in
another order on each rank, and hang); the save is published at the first step boundary
after every rank has written its part.

Loading never unpickles arbitrary objects: DCP's pickled `.metadata` is checked against the
manifest first and read through an allow-list unpickler; tensors are read with
weights_only=True.  The data files' checksums are computed as DCP's load reads them (the
reader hashes each rank's share of the files in file order, reader.py), and a
mismatch fails the run before its first step.

The package: state.py (the Stateful objects saved), manifest.py (checksums, the manifest and
the integrity checks), folders.py (step folders, `latest`, publishing, retention),
recovery.py (a written save the run stopped before publishing), start.py (which checkpoint
a run loads, decided once before any rank starts), staging.py (the async copy),
checkpointer.py (saving, publishing, loading), reader.py and writer.py (DCP's file system, changed), export.py (full
state dicts in and out, each rank its own rows), safetensors_io.py (safetensors files
written and read in pieces), cli.py (`composerun-ckpt`).
"""
