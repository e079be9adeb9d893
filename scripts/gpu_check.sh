#!/usr/bin/env bash
# One-GPU check of PipeMesh's GPU path, <= 8 minutes on one GPU with 16 CPU cores and no network:
# the executor's CUDA path for every pipeline rank role in one process (thread-ranks on their own streams,
# loopback copies on communication streams, also with delayed side-stream copies and without the caching
# allocator), PipeMesh on Megatron's default GPU path (NCCL, bf16, TE spec when TE imports, DDP with
# overlapped reduction and gathers, distributed optimizer, fused wgrad, host placement of chunk 0 and of the
# last stage's last chunk, ZeRO-2/3; ZeRO-2 with several backward groups), the CUDA allocator meter vs the
# activation model and, under host placement, vs the plan's peaks, a plan's pinned pool reserved up front,
# Megatron's recomputation switches, the pinned host link, pipemesh profile of a small GPT (every piece; kept
# bytes vs the saved-tensor meter), CUDA-event op timing vs wall time. One module per check in
# scripts/gpu_check_lib/; docs/gpu_check.md says what one GPU cannot check. Writes a JSON summary
# ($OUT/gpu_check.json when $OUT is set, else ./gpu_check.json, or --out PATH) after every check, so a run this
# timeout stops keeps its results, and prints it at the end; it lists passed, skipped (not passes) and failed
# checks apart; exit status 0 when none failed.
# --cpu-only runs every check on the CPU (CUDA-only ones say "skipped: needs CUDA"); --bench
# {skip,run,auto} (default skip) adds the 8-rank CPU benchmark; --only NAME[,NAME] runs those checks.
# Python: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
exec timeout --signal=TERM --kill-after=10 480 "$PY" scripts/gpu_check.py "$@"
