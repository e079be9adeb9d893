#!/usr/bin/env bash
# The embedded default: set up .venv, tokenize the shipped corpus into Megatron's indexed format,
# pretrain a tiny GPT on CPU (gloo, PP=2, VP=2, DP=NPROC/2) under the PipeMesh schedule, then run
# the same job under the stock schedule and print a side-by-side summary (losses, iteration time,
# measured peak activation memory per rank); then ask the advice what to run here (pipemesh bench --advice: profile
# the command, plan, run the advised row) and print its predicted and measured speed-up over the demo's command.
# --network RATE (root: a shaped NIC per rank, tc's syntax, e.g. 100mbit) runs the advice on a slow network, where
# PipeMesh has communication to hide; without it the ranks talk over plain loopback.
# Other arguments are passed to Megatron (e.g. --train-iters 100). With --pipeline-schedule in them
# the demo runs that one job only. NPROC (even: 2, 4, ...) and RUN_DIR may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
network=(--unshaped)
megatron=()
while [ $# -gt 0 ]; do
  case "$1" in
    --network) [ $# -ge 2 ] || { echo "error: --network needs a rate, e.g. --network 100mbit" >&2; exit 2; }
               network=(--rate "$2"); shift 2 ;;
    *) megatron+=("$1"); shift ;;
  esac
done
set -- ${megatron[@]+"${megatron[@]}"}
bash scripts/setup_env.sh
RUN_DIR=${RUN_DIR:-runs/demo}
NPROC=${NPROC:-2}
PP=2
if ! [[ $NPROC =~ ^[0-9]+$ ]] || [ "$NPROC" -lt "$PP" ] || [ $((NPROC % PP)) -ne 0 ]; then
  echo "error: NPROC=$NPROC: the demo runs PP=$PP pipeline ranks times DP data-parallel replicas, so NPROC must be a multiple of $PP (e.g. NPROC=2 or NPROC=4)" >&2
  exit 2
fi
DP=$((NPROC / PP)) MBS=4 GBS=32
if [ $((GBS % (MBS * DP))) -ne 0 ] || [ $((GBS / (MBS * DP))) -lt "$PP" ]; then
  echo "error: NPROC=$NPROC gives DP=$DP, too many replicas for the demo's global batch of $GBS (micro-batch $MBS): use NPROC <= $((2 * GBS / (MBS * PP)))" >&2
  exit 2
fi
M=$((GBS / (MBS * DP)))
# Elastic groups for m micro-batches: a large first forward group (long parameter-gather window),
# backward groups that keep the reduction window long; depth-first rules (each group >= p, every
# backward prefix <= the forward prefix) hold for every m >= p.
if [ "$M" -ge $((3 * PP)) ]; then
  FORWARD="$((M - PP)) $PP" BACKWARD="$((M / 2)) $((M - M / 2))"
elif [ $((M - PP)) -ge "$PP" ]; then
  FORWARD="$M" BACKWARD="$PP $((M - PP))"
else
  FORWARD="$M" BACKWARD="$M"
fi
mkdir -p "$RUN_DIR"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
PY=.venv/bin/python
if [ ! -f "$RUN_DIR/corpus.idx" ]; then
  $PY -m megatron_pipemesh.data.prepare --input megatron_pipemesh/data/corpus --output-prefix "$RUN_DIR/corpus"
fi
model=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
       --micro-batch-size "$MBS" --global-batch-size "$GBS")
job=(--data-path "$RUN_DIR/corpus" --tokenizer-type NullTokenizer --vocab-size 257 --split "98,1,1"
     --data-cache-path "$RUN_DIR/cache" "${model[@]}"
     --pipeline-model-parallel-size "$PP" --num-layers-per-virtual-pipeline-stage 1
     --train-iters 40 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 4 --weight-decay 0.01
     --clip-grad 1.0 --log-interval 5 --eval-interval 20 --eval-iters 2 --seed 1234 --num-workers 0
     --hidden-dropout 0 --attention-dropout 0)  # no dropout: masks are drawn in execution order, and the
     # summary compares the two schedules' losses iteration by iteration
train() {
  .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" scripts/pretrain_gpt.py "${job[@]}" "$@"
}
for arg in "$@"; do
  if [ "$arg" = "--pipeline-schedule" ]; then train "$@"; exit; fi
done

read -ra fwd <<<"$FORWARD"
read -ra bwd <<<"$BACKWARD"
echo "== PipeMesh: NPROC=$NPROC (PP=$PP x DP=$DP), m=$M, --forward-groups $FORWARD --backward-groups $BACKWARD"
train --pipeline-schedule pipemesh --forward-groups "${fwd[@]}" --backward-groups "${bwd[@]}" \
  --pipemesh-measure-memory --pipemesh-print-schedule "$@" 2>&1 | tee "$RUN_DIR/pipemesh.log"
echo "== stock Megatron schedule on the same data (log: $RUN_DIR/stock.log)"
train --pipeline-schedule default --pipemesh-measure-memory "$@" >"$RUN_DIR/stock.log" 2>&1 ||
  { tail -n 30 "$RUN_DIR/stock.log" >&2; exit 1; }
grep -E "iteration +[0-9]+/" "$RUN_DIR/stock.log" | tail -n 2
$PY -m megatron_pipemesh show --picture --pp "$PP" --vpp 2 -m "$M" \
  --forward-groups "${fwd[@]}" --backward-groups "${bwd[@]}" >"$RUN_DIR/schedule.txt"
$PY -m megatron_pipemesh simulate --pp "$PP" --vpp 2 -m "$M" --forward-groups "${fwd[@]}" --backward-groups "${bwd[@]}" \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --micro-batch-size "$MBS" \
  --vocab-size 257 --dp "$DP" --trace "$RUN_DIR/trace.json" >/dev/null
echo "== what should this command run here? pipemesh bench --advice ${network[*]} (log: $RUN_DIR/advice.log)"
rm -rf "$RUN_DIR/advice"
$PY -m megatron_pipemesh bench --advice --only-advised --megatron-args "${job[*]} $*" --nproc "$NPROC" "${network[@]}" \
  --warmup 2 --iters 4 --profile-max-seconds 2 --out-dir "$RUN_DIR/advice" --json "$RUN_DIR/advice.json" >"$RUN_DIR/advice.log" 2>&1 ||
  { tail -n 30 "$RUN_DIR/advice.log" >&2; exit 1; }
$PY -m megatron_pipemesh.bench.demo_summary --pipemesh "$RUN_DIR/pipemesh.log" --stock "$RUN_DIR/stock.log" \
  --picture "$RUN_DIR/schedule.txt" --trace "$RUN_DIR/trace.json" --advice "$RUN_DIR/advice.json"
