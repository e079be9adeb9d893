#!/usr/bin/env bash
# Runs once per node under srun (started by scripts/slurm/*.sbatch): replaces every "{NODE_RANK}"
# in its arguments by this node's rank in the job (SLURM_NODEID, else SLURM_PROCID with one task
# per node) and execs the result. With PIPEMESH_DRY_RUN=1 it prints the command instead.
set -euo pipefail
rank=${SLURM_NODEID:-${SLURM_PROCID:-}}
if [ -z "$rank" ]; then
  echo "error: srun_node.sh: neither SLURM_NODEID nor SLURM_PROCID is set; it must run under srun (one task per node)" >&2
  exit 2
fi
if [ $# -eq 0 ]; then
  echo "error: srun_node.sh: no command given (usage: srun_node.sh COMMAND [ARGS...])" >&2
  exit 2
fi
pattern='{NODE_RANK}'
args=()
for a in "$@"; do
  args+=("${a//"$pattern"/$rank}")
done
if [ "${PIPEMESH_DRY_RUN:-0}" = 1 ]; then
  # shellcheck source-path=SCRIPTDIR source=common.sh
  source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
  pm_print_cmd "${args[@]}"
else
  exec "${args[@]}"
fi
