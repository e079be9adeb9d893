# shellcheck shell=bash disable=SC2034
# Shared helpers of the PipeMesh launch scripts (scripts/pretrain_gpt_pipemesh.sh,
# scripts/slurm/*.sbatch). Source it; it defines functions and PM_* variables only.
#
#   pm_die / pm_warn / pm_info         messages on stderr ("error: ..." exits with status 2)
#   pm_quote / pm_print_cmd            shell-quote words (POSIX single quotes, like Python's shlex.quote)
#   pm_run / pm_exec / pm_setenv       run, exec or export -- or, with PM_DRY_RUN=1, print instead
#   pm_load_config / pm_set_key        read a configs/*.env file (KEY=VALUE, no shell evaluation)
#   pm_model_args                      the Megatron flags a config stands for -> PM_MODEL_ARGS
#   pm_expand_nodelist / pm_first_node Slurm node lists (scontrol, or a pure-bash parser)
#   pm_network_env                     NCCL / gloo / CUDA environment of a run

PM_DRY_RUN=${PM_DRY_RUN:-0}
PM_ENTRY_MODULE=megatron_pipemesh.training.pretrain_gpt

pm_die() {
  printf 'error: %s\n' "$*" >&2
  exit 2
}

pm_warn() {
  printf 'warning: %s\n' "$*" >&2
}

pm_info() {
  printf '%s\n' "$*" >&2
}

# pm_quote WORD: WORD as one shell word (unquoted when safe, else in single quotes).
pm_quote() {
  local s=$1
  if [ -z "$s" ]; then
    printf "''"
  elif [[ $s =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# pm_print_cmd WORD...: one line, each word quoted.
pm_print_cmd() {
  local out="" w
  for w in "$@"; do
    out+="${out:+ }$(pm_quote "$w")"
  done
  printf '%s\n' "$out"
}

# pm_run CMD...: run CMD, or print it under --dry-run.
pm_run() {
  if [ "$PM_DRY_RUN" = 1 ]; then pm_print_cmd "$@"; else "$@"; fi
}

# pm_exec CMD...: exec CMD, or print it under --dry-run (and return).
pm_exec() {
  if [ "$PM_DRY_RUN" = 1 ]; then pm_print_cmd "$@"; else exec "$@"; fi
}

# pm_setenv NAME VALUE: export NAME=VALUE (and print "export NAME=VALUE" under --dry-run).
pm_setenv() {
  export "$1=$2"
  if [ "$PM_DRY_RUN" = 1 ]; then printf 'export %s=%s\n' "$1" "$(pm_quote "$2")"; fi
}

# pm_need_value OPTION "$@": fail unless OPTION is followed by a value.
pm_need_value() {
  if [ $# -lt 2 ] || [ -z "$2" ]; then
    pm_die "$1 needs a value (see --help)"
  fi
}

pm_is_uint() {
  [[ $1 =~ ^[0-9]+$ ]]
}

# --------------------------------------------------------------------------------------------------
# Configs: configs/*.env hold KEY=VALUE lines (see configs/README.md and docs/launching.md).
# They are parsed, not sourced: no shell expansion, unknown keys are errors.
# --------------------------------------------------------------------------------------------------
# PipeMesh's own keys (SCHEDULE, FORWARD_GROUPS, ...) and their flags are generated from the
# PipeMeshConfig dataclass (python -m megatron_pipemesh.config --bash > scripts/lib/pipemesh_keys.sh).
# shellcheck source-path=SCRIPTDIR source=pipemesh_keys.sh
source "$(dirname "${BASH_SOURCE[0]}")/pipemesh_keys.sh"
PM_CONFIG_KEYS=(
  NUM_LAYERS HIDDEN_SIZE FFN_HIDDEN_SIZE NUM_ATTENTION_HEADS NUM_QUERY_GROUPS SEQ_LENGTH
  MAX_POSITION_EMBEDDINGS MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE
  TP PP VP LAYERS_PER_VP_STAGE SEQUENCE_PARALLEL
  "${PM_PIPEMESH_KEYS[@]}"
  NNODES GPUS_PER_NODE NETWORK EXTRA_ARGS
)
declare -A PM_CFG=()
PM_CONFIG_FILE=""

pm_is_config_key() {
  local k
  for k in "${PM_CONFIG_KEYS[@]}"; do
    if [ "$k" = "$1" ]; then return 0; fi
  done
  return 1
}

# pm_check_value KEY VALUE WHERE: validate one config value (WHERE names the file:line or --set).
pm_check_value() {
  local key=$1 value=$2 where=$3 w
  [ -z "$value" ] && return 0
  local kind=${PM_PIPEMESH_KIND[$key]:-}
  case $key in
    NUM_LAYERS|HIDDEN_SIZE|FFN_HIDDEN_SIZE|NUM_ATTENTION_HEADS|NUM_QUERY_GROUPS|SEQ_LENGTH|\
    MAX_POSITION_EMBEDDINGS|MICRO_BATCH_SIZE|GLOBAL_BATCH_SIZE|TP|PP|VP|LAYERS_PER_VP_STAGE|\
    NNODES|GPUS_PER_NODE)
      kind=uint
      ;;
    SEQUENCE_PARALLEL)
      kind=bool
      ;;
    NETWORK)
      kind='choice:auto|ethernet|ib'
      ;;
  esac
  case $kind in
    uint)
      pm_is_uint "$value" || pm_die "$where: $key=$value is not a non-negative integer"
      ;;
    number)
      [[ $value =~ ^[0-9]+([.][0-9]*)?$ ]] || pm_die "$where: $key=$value is not a non-negative number"
      ;;
    bool)
      [[ $value =~ ^[01]$ ]] || pm_die "$where: $key=$value must be 0 or 1"
      ;;
    choice:*)
      [[ "|${kind#choice:}|" == *"|$value|"* ]] || pm_die "$where: $key=$value must be one of: ${kind#choice:}"
      ;;
    words:*)
      for w in $value; do
        [[ "|${kind#words:}|" == *"|$w|"* ]] || pm_die "$where: $key='$value': each word must be one of: ${kind#words:}"
      done
      ;;
    groups)
      for w in $value; do
        pm_is_uint "$w" || [ "$w" = auto ] ||
          pm_die "$where: $key='$value': each group must be a positive integer (or 'auto'), e.g. $key=\"8 4\""
      done
      ;;
  esac
}

# pm_set_key KEY=VALUE WHERE: set (or, with an empty value, clear) one config key.
pm_set_key() {
  local kv=$1 where=$2 key value
  [[ $kv =~ ^([A-Z_][A-Z0-9_]*)=(.*)$ ]] || pm_die "$where: expected KEY=VALUE, got '$kv'"
  key=${BASH_REMATCH[1]}
  value=${BASH_REMATCH[2]}
  pm_is_config_key "$key" || pm_die "$where: unknown key $key (known keys: ${PM_CONFIG_KEYS[*]})"
  pm_check_value "$key" "$value" "$where"
  PM_CFG[$key]=$value
}

# pm_load_config FILE: read a KEY=VALUE file into PM_CFG.
pm_load_config() {
  local file=$1 line n=0 key value
  [ -f "$file" ] || pm_die "config file '$file' not found (pass an existing file to --config, e.g. --config configs/gpt-1.3b.env; the shipped ones are in configs/)"
  PM_CONFIG_FILE=$file
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line=${line#"${line%%[![:space:]]*}"}
    [ -z "$line" ] && continue
    [ "${line:0:1}" = "#" ] && continue
    line=${line#export }
    [[ $line =~ ^([A-Z_][A-Z0-9_]*)=(.*)$ ]] || pm_die "$file:$n: expected KEY=VALUE, got '$line'"
    key=${BASH_REMATCH[1]}
    value=${BASH_REMATCH[2]}
    if [[ $value =~ ^\"([^\"]*)\"[[:space:]]*(#.*)?$ ]] || [[ $value =~ ^\'([^\']*)\'[[:space:]]*(#.*)?$ ]]; then
      value=${BASH_REMATCH[1]}
    else
      [[ $value == *[\"\']* ]] && pm_die "$file:$n: unbalanced quotes in '$line'"
      value=${value%%[[:space:]]#*}
      value=${value%"${value##*[![:space:]]}"}
    fi
    pm_set_key "$key=$value" "$file:$n"
  done <"$file"
}

pm_cfg() {
  printf '%s' "${PM_CFG[$1]:-}"
}

# pm_flag_value FLAG WORD...: the value of the last FLAG (or FLAG=value) among WORDs; status 1 if absent.
pm_flag_value() {
  local flag=$1 found=1 value="" i
  shift
  local words=("$@")
  for ((i = 0; i < ${#words[@]}; i++)); do
    if [ "${words[i]}" = "$flag" ] && [ $((i + 1)) -lt ${#words[@]} ]; then
      value=${words[i + 1]}; found=0
    elif [[ ${words[i]} == "$flag="* ]]; then
      value=${words[i]#*=}; found=0
    fi
  done
  printf '%s' "$value"
  return $found
}

# pm_has_flag FLAG WORD...: status 0 when FLAG (or FLAG=...) is among WORDs.
pm_has_flag() {
  local flag=$1 w
  shift
  for w in "$@"; do
    if [ "$w" = "$flag" ] || [[ $w == "$flag="* ]]; then return 0; fi
  done
  return 1
}

# pm_model_args PASSTHROUGH...: fill PM_MODEL_ARGS with the Megatron flags of the loaded config.
# Flags the user passes through come later on the command line (Megatron's parser keeps the last
# value); config flags that would conflict with passed-through ones are left out:
#   * --pipeline-schedule given: the config's groups only when that schedule is pipemesh;
#   * --pipemesh-plan given: the config's groups are left out (the plan file holds them);
#   * a virtual-pipeline flag given: the config's VP / LAYERS_PER_VP_STAGE are left out.
pm_model_args() {
  local -a pass=("$@") words
  local schedule v
  PM_MODEL_ARGS=()
  local -A flags=(
    [NUM_LAYERS]=--num-layers [HIDDEN_SIZE]=--hidden-size [FFN_HIDDEN_SIZE]=--ffn-hidden-size
    [NUM_ATTENTION_HEADS]=--num-attention-heads [NUM_QUERY_GROUPS]=--num-query-groups
    [SEQ_LENGTH]=--seq-length [MAX_POSITION_EMBEDDINGS]=--max-position-embeddings
    [MICRO_BATCH_SIZE]=--micro-batch-size [GLOBAL_BATCH_SIZE]=--global-batch-size
    [TP]=--tensor-model-parallel-size [PP]=--pipeline-model-parallel-size
  )
  local key
  for key in NUM_LAYERS HIDDEN_SIZE FFN_HIDDEN_SIZE NUM_ATTENTION_HEADS NUM_QUERY_GROUPS SEQ_LENGTH \
             MAX_POSITION_EMBEDDINGS MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TP PP; do
    v=$(pm_cfg "$key")
    if [ "$key" = NUM_QUERY_GROUPS ] && [ -n "$v" ]; then PM_MODEL_ARGS+=(--group-query-attention); fi
    if [ "$key" = MAX_POSITION_EMBEDDINGS ] && [ -z "$v" ]; then v=$(pm_cfg SEQ_LENGTH); fi
    if [ -n "$v" ]; then PM_MODEL_ARGS+=("${flags[$key]}" "$v"); fi
  done
  if [ "$(pm_cfg SEQUENCE_PARALLEL)" = 1 ]; then PM_MODEL_ARGS+=(--sequence-parallel); fi
  if ! pm_has_flag --num-virtual-stages-per-pipeline-rank "${pass[@]}" &&
     ! pm_has_flag --num-layers-per-virtual-pipeline-stage "${pass[@]}"; then
    v=$(pm_cfg VP)
    if [ -n "$v" ] && [ "$v" -gt 1 ]; then PM_MODEL_ARGS+=(--num-virtual-stages-per-pipeline-rank "$v"); fi
    v=$(pm_cfg LAYERS_PER_VP_STAGE)
    if [ -n "$v" ]; then PM_MODEL_ARGS+=(--num-layers-per-virtual-pipeline-stage "$v"); fi
  fi
  schedule=$(pm_cfg SCHEDULE)
  if pm_has_flag --pipeline-schedule "${pass[@]}"; then
    schedule=$(pm_flag_value --pipeline-schedule "${pass[@]}" || true)
  elif [ -n "$schedule" ]; then
    PM_MODEL_ARGS+=(--pipeline-schedule "$schedule")
  fi
  if [ "$schedule" = pipemesh ]; then
    # Every other PipeMesh key, generically from the generated tables; a plan file holds the groups.
    for key in "${PM_PIPEMESH_KEYS[@]}"; do
      [ "$key" = SCHEDULE ] && continue
      v=$(pm_cfg "$key")
      [ -n "$v" ] || continue
      if [ "${PM_PIPEMESH_KIND[$key]}" = groups ] && pm_has_flag --pipemesh-plan "${pass[@]}"; then continue; fi
      case ${PM_PIPEMESH_KIND[$key]} in
        bool) if [ "$v" = 1 ]; then PM_MODEL_ARGS+=("${PM_PIPEMESH_FLAG[$key]}"); fi ;;
        groups|words:*) read -ra words <<<"$v"; PM_MODEL_ARGS+=("${PM_PIPEMESH_FLAG[$key]}" "${words[@]}") ;;
        *) PM_MODEL_ARGS+=("${PM_PIPEMESH_FLAG[$key]}" "$v") ;;
      esac
    done
  fi
  v=$(pm_cfg EXTRA_ARGS)
  if [ -n "$v" ]; then read -ra words <<<"$v"; PM_MODEL_ARGS+=("${words[@]}"); fi
}

# pm_microbatches WORLD: m = GLOBAL_BATCH_SIZE / (MICRO_BATCH_SIZE * DP) from the config, or "".
pm_microbatches() {
  local world=$1 tp pp gbs mbs dp
  tp=$(pm_cfg TP); pp=$(pm_cfg PP); gbs=$(pm_cfg GLOBAL_BATCH_SIZE); mbs=$(pm_cfg MICRO_BATCH_SIZE)
  tp=${tp:-1}; pp=${pp:-1}
  if [ -z "$gbs" ] || [ -z "$mbs" ] || [ "$((tp * pp))" -eq 0 ] || [ $((world % (tp * pp))) -ne 0 ]; then
    return 0
  fi
  dp=$((world / (tp * pp)))
  if [ $((gbs % (mbs * dp))) -ne 0 ]; then return 0; fi
  printf '%s' $((gbs / (mbs * dp)))
}

# pm_check_world WORLD: warn early when the config does not fit WORLD ranks (Megatron would fail later).
pm_check_world() {
  local world=$1 tp pp m sum g key
  tp=$(pm_cfg TP); pp=$(pm_cfg PP); tp=${tp:-1}; pp=${pp:-1}
  [ -n "$PM_CONFIG_FILE" ] || return 0
  if [ $((world % (tp * pp))) -ne 0 ]; then
    pm_warn "$world ranks are not a multiple of TP*PP = $((tp * pp)) ($PM_CONFIG_FILE)"
    return 0
  fi
  m=$(pm_microbatches "$world")
  if [ -z "$m" ]; then
    if [ -n "$(pm_cfg GLOBAL_BATCH_SIZE)" ] && [ -n "$(pm_cfg MICRO_BATCH_SIZE)" ]; then
      pm_warn "GLOBAL_BATCH_SIZE=$(pm_cfg GLOBAL_BATCH_SIZE) is not a multiple of MICRO_BATCH_SIZE x DP = $(pm_cfg MICRO_BATCH_SIZE) x $((world / (tp * pp))) for $world ranks ($PM_CONFIG_FILE)"
    fi
    return 0
  fi
  for key in FORWARD_GROUPS BACKWARD_GROUPS; do
    [[ " $(pm_cfg "$key") " == *" auto "* ]] && continue
    sum=0
    for g in $(pm_cfg "$key"); do sum=$((sum + g)); done
    if [ "$sum" -gt 0 ] && [ "$sum" -ne "$m" ]; then
      pm_warn "$key=\"$(pm_cfg "$key")\" in $PM_CONFIG_FILE sums to $sum, but $world ranks with TP=$tp PP=$pp give m = $m micro-batches per iteration (DP = $((world / (tp * pp)))); re-plan for this size (pipemesh simulate/plan, see docs/launching.md) and pass --set $key=\"...\""
    fi
  done
}

# --------------------------------------------------------------------------------------------------
# Interpreter and Megatron-LM checkout
# --------------------------------------------------------------------------------------------------
# pm_resolve_python NAME: check the interpreter that runs torchrun and the training entry point.
pm_resolve_python() {
  local py=$1
  command -v "$py" >/dev/null 2>&1 ||
    pm_die "Python interpreter '$py' not found: pass --python PATH or set PIPEMESH_PYTHON to the python of the environment where torch, megatron-core and megatron_pipemesh are installed"
  if [ "$PM_DRY_RUN" != 1 ]; then
    "$py" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("megatron_pipemesh") and u.find_spec("torch") else 1)' ||
      pm_die "'$py' cannot import megatron_pipemesh and torch: install the package there (pip install /path/to/megatron_pipemesh) or pass --python / PIPEMESH_PYTHON for the right environment"
  fi
}

# pm_megatron_lm DIR: check a Megatron-LM checkout; sets PM_SCRIPT_ARGS (the --megatron-lm-script flag).
pm_megatron_lm() {
  local dir=$1
  PM_SCRIPT_ARGS=()
  [ -z "$dir" ] && return 0
  [ -d "$dir" ] || pm_die "Megatron-LM checkout '$dir' (--megatron-lm-dir / MEGATRON_LM_DIR) is not a directory; unset MEGATRON_LM_DIR to use megatron_pipemesh's own pretrain_gpt"
  [ -f "$dir/pretrain_gpt.py" ] || pm_die "'$dir' (--megatron-lm-dir / MEGATRON_LM_DIR) has no pretrain_gpt.py: point it at the root of a Megatron-LM checkout (e.g. git clone -b core_r0.19.0 https://github.com/NVIDIA/Megatron-LM)"
  dir=$(cd "$dir" && pwd)
  PM_SCRIPT_ARGS=(--megatron-lm-script "$dir/pretrain_gpt.py")
  pm_setenv PYTHONPATH "$dir${PYTHONPATH:+:$PYTHONPATH}"
}

# pm_network_env IFNAME NETWORK: NCCL / gloo / CUDA settings of a run.
pm_network_env() {
  local ifname=$1 network=$2
  pm_setenv CUDA_DEVICE_MAX_CONNECTIONS "${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
  pm_setenv OMP_NUM_THREADS "${OMP_NUM_THREADS:-1}"
  pm_setenv TORCH_NCCL_ASYNC_ERROR_HANDLING "${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  if [ -n "$ifname" ]; then
    pm_setenv NCCL_SOCKET_IFNAME "$ifname"
    pm_setenv GLOO_SOCKET_IFNAME "$ifname"
  fi
  case $network in
    ethernet) pm_setenv NCCL_IB_DISABLE 1 ;;
    ib) pm_setenv NCCL_IB_DISABLE 0 ;;
    auto|"") ;;
    *) pm_die "--network $network: expected auto, ethernet or ib" ;;
  esac
}

# --------------------------------------------------------------------------------------------------
# Slurm node lists
# --------------------------------------------------------------------------------------------------
# _pm_expand_host HOST: expand bracket ranges of one host expression (node[01-03,07]-ib[1-2]).
_pm_expand_host() {
  local expr=$1 prefix inner rest part lo hi width i suffix
  local -a parts
  if [[ $expr != *"["* ]]; then
    printf '%s\n' "$expr"
    return 0
  fi
  prefix=${expr%%\[*}
  inner=${expr#*\[}
  rest=${inner#*\]}
  inner=${inner%%\]*}
  [ "$inner" != "${expr#*\[}" ] || pm_die "cannot parse node list element '$expr' (unbalanced '[')"
  IFS=, read -ra parts <<<"$inner"
  for part in "${parts[@]}"; do
    if [[ $part =~ ^([0-9]+)-([0-9]+)$ ]]; then
      lo=${BASH_REMATCH[1]}; hi=${BASH_REMATCH[2]}; width=${#lo}
      for ((i = 10#$lo; i <= 10#$hi; i++)); do
        printf -v suffix '%0*d' "$width" "$i"
        _pm_expand_host "$prefix$suffix$rest"
      done
    elif [[ $part =~ ^[0-9A-Za-z_.-]+$ ]]; then
      _pm_expand_host "$prefix$part$rest"
    else
      pm_die "cannot parse node list element '$expr' (range '$part')"
    fi
  done
}

# pm_expand_nodelist LIST: one host per line, without scontrol ("node[01-03,07],gpu5").
pm_expand_nodelist() {
  local list=$1 depth=0 cur="" c i
  for ((i = 0; i < ${#list}; i++)); do
    c=${list:i:1}
    case $c in
      "[") depth=$((depth + 1)); cur+=$c ;;
      "]") depth=$((depth - 1)); cur+=$c ;;
      ",")
        if [ $depth -eq 0 ]; then
          [ -n "$cur" ] && _pm_expand_host "$cur"
          cur=""
        else
          cur+=$c
        fi
        ;;
      *) cur+=$c ;;
    esac
  done
  if [ -n "$cur" ]; then _pm_expand_host "$cur"; fi
}

# pm_hostnames LIST: hosts of a Slurm node list, via `scontrol show hostnames` when available.
pm_hostnames() {
  local list=$1 out
  if command -v scontrol >/dev/null 2>&1 && out=$(scontrol show hostnames "$list" 2>/dev/null) && [ -n "$out" ]; then
    printf '%s\n' "$out"
  else
    pm_expand_nodelist "$list"
  fi
}

# pm_gpus_per_node: GPUs per node from Slurm (SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE=[type:]N), or "".
pm_gpus_per_node() {
  local v
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then v=$SLURM_GPUS_ON_NODE
  elif [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then v=${SLURM_GPUS_PER_NODE##*:}
  else v=""
  fi
  v=${v%%(*}
  if pm_is_uint "$v"; then printf '%s' "$v"; fi
}

# pm_local_gpus: number of GPUs nvidia-smi lists on this machine, or "".
pm_local_gpus() {
  local n
  if command -v nvidia-smi >/dev/null 2>&1 && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [ "$n" -gt 0 ]; then
    printf '%s' "$n"
  fi
}
