#!/usr/bin/env bash
# The wheels scripts/gpu_check.py installs on the GPU machine (Python 3.12, x86-64 Linux, its own
# torch, no network), downloaded here into .whl/ (git-ignored; it travels with the working tree
# when the device run names it in `carry`):
#   .whl/             what composerun needs and that machine lacks: hydra-core, omegaconf, antlr4
#                     (a source distribution only: built into a wheel here), torchao (float8);
#                     the versions this repository's environment is tested with
#   .whl/torchtitan/  torchtitan and what it needs beside the machine's packages, for the
#                     side-by-side run (installed into a directory of its own there)
# Usage: scripts/gpu_check_wheels.sh [--no-torchtitan]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() { "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$@"; }

rm -rf .whl && mkdir -p .whl
download .whl hydra-core==1.3.8 omegaconf==2.3.1 torchao==0.18.0
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # pure Python: any 3.x

if [[ "${1:-}" != "--no-torchtitan" ]]; then
  mkdir -p .whl/torchtitan
  # torchtitan 0.3.0's requirements the GPU image lacks (it has tokenizers, safetensors, tensorboard,
  # einops, pillow, fsspec, pyarrow, pandas, requests, httpx, huggingface-hub); wandb is imported
  # only when enabled.  datasets <4.8 wants dill <0.4.1 and multiprocess <0.70.19.
  download .whl/torchtitan torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 \
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
fi
find .whl -type f -name '*.whl' -printf '%s\t%p\n' | sort -k2
du -sb .whl | awk '{printf "total %.1f MiB (a device run carries at most 64 MiB with the tree)\n", $1 / 1048576}'
