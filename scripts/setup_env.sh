#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment in .venv with the pinned stack:
# torch 2.13.0 (CPU build on this machine), numpy < 2.5 (binary only), megatron-core 0.19.2
# (its wheel is cp311 although it declares Python >= 3.12, hence --ignore-requires-python),
# then installs this package in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
stamp="$VENV/.pipemesh-stack"
want="torch==2.13.0 megatron-core==0.19.2 numpy<2.5 psutil einops~=0.8"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
  "$PIP" install -q torch==2.13.0
  "$PIP" install -q --only-binary=:all: "numpy<2.5"
  "$PIP" install -q --ignore-requires-python megatron-core==0.19.2
  # psutil: megatron-core's checkpoint writer needs it (not declared by the wheel); einops: its
  # hierarchical distributed optimizer (--pipemesh-shard-scope node; parallel_state.py:401, a "dev" extra).
  "$PIP" install -q psutil "einops~=0.8"
  echo "$want" > "$stamp"
fi
"$PIP" install -q -e ".[test]"
