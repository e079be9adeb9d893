#!/usr/bin/env bash
# Single-node GPT pretraining with PipeMesh available, through torchrun. See --help and
# docs/launching.md.
set -euo pipefail

PM_HOME=${PIPEMESH_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$PM_HOME/scripts/lib/common.sh"

usage() {
  cat <<'EOF'
Usage: scripts/pretrain_gpt_pipemesh.sh [OPTIONS] [--] [MEGATRON / PIPEMESH FLAGS...]

Pretrain a GPT with Megatron on this machine (torchrun, one process per GPU, or per CPU slot
without CUDA), with PipeMesh's --pipeline-schedule pipemesh available. The training command is
  PYTHON -m torch.distributed.run ... -m megatron_pipemesh.training.pretrain_gpt \
      <flags from --config> [--megatron-lm-script DIR/pretrain_gpt.py] <your flags>
Everything after "--", and every option not listed below, goes to the training command unchanged
(standard Megatron flags and PipeMesh's --pipeline-schedule, --forward-groups, --backward-groups,
--pipemesh-recv-lookahead). Your flags come after the config's, so they win.

Options (environment variable in brackets):
  --config FILE            model / parallelism / group settings, KEY=VALUE lines
                           (configs/*.env) [PIPEMESH_CONFIG]; optional: without it all flags
                           come from the command line
  --set KEY=VALUE          override one config key (repeatable; an empty VALUE removes it),
                           e.g. --set FORWARD_GROUPS="8 4" --set GLOBAL_BATCH_SIZE=256
  --nproc N, --nproc-per-node N
                           ranks on this machine [NPROC_PER_NODE]; default: the config's
                           GPUS_PER_NODE, else the number of GPUs nvidia-smi lists
  --python PATH            interpreter with torch, megatron-core and megatron_pipemesh
                           [PIPEMESH_PYTHON]; default: python3
  --megatron-lm-dir DIR    run DIR/pretrain_gpt.py of your Megatron-LM checkout instead of
                           megatron_pipemesh's entry point (DIR goes first on PYTHONPATH)
                           [MEGATRON_LM_DIR]
  --run-dir DIR            where logs go: DIR/torchrun/<run id>/attempt_0/<rank>/stdout.log
                           and stderr.log [PIPEMESH_RUN_DIR]; default: runs/<config>-<date-time>
  --master-port PORT       fixed rendezvous port on 127.0.0.1 [MASTER_PORT]; default:
                           torchrun --standalone (a free port)
  --ifname IFACE           network interface for NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
                           [PIPEMESH_IFNAME]; default: unset (NCCL / gloo choose)
  --network auto|ethernet|ib
                           ethernet sets NCCL_IB_DISABLE=1, ib sets 0, auto leaves it
                           [PIPEMESH_NETWORK]; default: the config's NETWORK, else auto
  --dry-run                print the commands (one per line, shell-quoted) instead of running
                           them [PIPEMESH_DRY_RUN=1]
  -h, --help               this text

Always set (unless already in the environment): CUDA_DEVICE_MAX_CONNECTIONS=1,
OMP_NUM_THREADS=1, TORCH_NCCL_ASYNC_ERROR_HANDLING=1. Without CUDA the entry point adds the CPU
flags itself (gloo, local transformer, ...), so the same command runs on CPU.

Example (CPU, the shipped corpus):
  python -m megatron_pipemesh.data.prepare --output-prefix data-cache/corpus
  scripts/pretrain_gpt_pipemesh.sh --config configs/tiny-cpu.env --python .venv/bin/python -- \
      --data-path data-cache/corpus --tokenizer-type NullTokenizer --vocab-size 257
EOF
}

config=${PIPEMESH_CONFIG:-}
nproc=${NPROC_PER_NODE:-}
python=${PIPEMESH_PYTHON:-python3}
megatron_lm_dir=${MEGATRON_LM_DIR:-}
run_dir=${PIPEMESH_RUN_DIR:-}
master_port=${MASTER_PORT:-}
ifname=${PIPEMESH_IFNAME:-}
network=${PIPEMESH_NETWORK:-}
PM_DRY_RUN=${PIPEMESH_DRY_RUN:-0}
sets=()
pass=()

while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --dry-run) PM_DRY_RUN=1; shift ;;
    --config) pm_need_value "$@"; config=$2; shift 2 ;;
    --config=*) config=${1#*=}; shift ;;
    --set) pm_need_value "$@"; sets+=("$2"); shift 2 ;;
    --set=*) sets+=("${1#*=}"); shift ;;
    --nproc|--nproc-per-node) pm_need_value "$@"; nproc=$2; shift 2 ;;
    --nproc=*|--nproc-per-node=*) nproc=${1#*=}; shift ;;
    --python) pm_need_value "$@"; python=$2; shift 2 ;;
    --python=*) python=${1#*=}; shift ;;
    --megatron-lm-dir) pm_need_value "$@"; megatron_lm_dir=$2; shift 2 ;;
    --megatron-lm-dir=*) megatron_lm_dir=${1#*=}; shift ;;
    --run-dir) pm_need_value "$@"; run_dir=$2; shift 2 ;;
    --run-dir=*) run_dir=${1#*=}; shift ;;
    --master-port) pm_need_value "$@"; master_port=$2; shift 2 ;;
    --master-port=*) master_port=${1#*=}; shift ;;
    --ifname) pm_need_value "$@"; ifname=$2; shift 2 ;;
    --ifname=*) ifname=${1#*=}; shift ;;
    --network) pm_need_value "$@"; network=$2; shift 2 ;;
    --network=*) network=${1#*=}; shift ;;
    --) shift; pass+=("$@"); break ;;
    *) pass+=("$1"); shift ;;
  esac
done

if [ -n "$config" ]; then pm_load_config "$config"; fi
for kv in "${sets[@]}"; do pm_set_key "$kv" "--set $kv"; done

if [ -z "$nproc" ]; then nproc=$(pm_cfg GPUS_PER_NODE); fi
if [ -z "$nproc" ]; then nproc=$(pm_local_gpus); fi
[ -n "$nproc" ] || pm_die "cannot tell how many ranks to start: no GPUs found and no GPUS_PER_NODE in a config; pass --nproc N (or set NPROC_PER_NODE)"
if ! pm_is_uint "$nproc" || [ "$nproc" -eq 0 ]; then pm_die "--nproc '$nproc' is not a positive integer"; fi
if [ -n "$master_port" ]; then
  pm_is_uint "$master_port" || pm_die "--master-port '$master_port' is not a port number"
fi
network=${network:-$(pm_cfg NETWORK)}

pm_resolve_python "$python"
pm_check_world "$nproc"
pm_model_args "${pass[@]}"
pm_megatron_lm "$megatron_lm_dir"

if [ -z "$run_dir" ]; then
  name=pretrain
  if [ -n "$config" ]; then name=$(basename "${config%.*}"); fi
  run_dir=runs/$name-$(date +%Y%m%d-%H%M%S)
fi

if [ -n "$master_port" ]; then
  rdzv=(--master-addr 127.0.0.1 --master-port "$master_port")
else
  rdzv=(--standalone)
fi

pm_network_env "$ifname" "$network"
pm_run mkdir -p "$run_dir/torchrun"
if [ "$PM_DRY_RUN" != 1 ]; then
  pm_info "pretrain_gpt_pipemesh: $nproc ranks; per-rank logs under $run_dir/torchrun/"
fi
pm_exec "$python" -m torch.distributed.run "${rdzv[@]}" --nnodes 1 --nproc-per-node "$nproc" \
  --log-dir "$run_dir/torchrun" --tee 3 \
  -m "$PM_ENTRY_MODULE" "${PM_MODEL_ARGS[@]}" "${PM_SCRIPT_ARGS[@]}" "${pass[@]}"
