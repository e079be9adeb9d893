#!/usr/bin/env bash
# The advice's accuracy ledger: `pipemesh bench --advice` on 2 ranks (a core each, a shaped NIC per rank: root) over
# the commands below, then one table and one JSON (python -m megatron_pipemesh.bench.advice_ledger). Run it on an
# idle machine; about 60 minutes with REPEATS=2, half with REPEATS=1.
#   bash scripts/advice_accuracy.sh                      # every command -> runs/ledger/{NAME.json,ledger.json,ledger.md}
#   ONLY="llama-pp2 moe-ep2" bash scripts/advice_accuracy.sh
#   WRITE_ERRORS=1 bash scripts/advice_accuracy.sh       # also store the worst error per kind of row as the advice's
#                                                        # error table (megatron_pipemesh/planning/advice_error.json)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
OUT=${OUT:-runs/ledger}
REPEATS=${REPEATS:-2}
mkdir -p "$OUT"
BASE="--seq-length 256 --max-position-embeddings 256 --mock-data --tokenizer-type NullTokenizer --vocab-size 2048 --train-iters 100 --lr 1e-4"
GPT="--num-layers 4 --hidden-size 256 --num-attention-heads 8 $BASE"
LLAMA="--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear $BASE"
LLAMA8=${LLAMA/--num-layers 4/--num-layers 8}
MOE="$GPT --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --disable-bias-linear"
# name | rate (Mbit/s per rank) | the user's command
COMMANDS=(
  "gpt-pp2|100|$GPT --micro-batch-size 2 --global-batch-size 16 --pipeline-model-parallel-size 2"
  "llama-pp2|100|$LLAMA --micro-batch-size 2 --global-batch-size 16 --pipeline-model-parallel-size 2"
  "gpt-dp2|100|$GPT --micro-batch-size 2 --global-batch-size 16"
  "llama-pp2-v2|80|$LLAMA8 --micro-batch-size 1 --global-batch-size 16 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"
  "gpt-distopt-dp2|200|$GPT --micro-batch-size 4 --global-batch-size 32 --use-distributed-optimizer"
  "moe-ep2|100|$MOE --micro-batch-size 2 --global-batch-size 16"
  "gpt-pp2-mbs4|200|$GPT --micro-batch-size 4 --global-batch-size 32 --pipeline-model-parallel-size 2"
  "llama-dp2-mbs1|50|$LLAMA --micro-batch-size 1 --global-batch-size 8"
)
done_files=()
for entry in "${COMMANDS[@]}"; do
  IFS="|" read -r name rate command <<<"$entry"
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
  echo "== $name at $rate Mbit/s: $command" >&2
  start=$SECONDS
  .venv/bin/pipemesh bench --advice --megatron-args "$command" --nproc 2 --rate "${rate}mbit" --warmup 2 --iters 4 \
    --repeats "$REPEATS" --out-dir "$OUT/$name" --json "$OUT/$name.json" >"$OUT/$name.txt" 2>"$OUT/$name.log" ||
    { echo "$name failed (exit $?): $OUT/$name.log" >&2; tail -n 5 "$OUT/$name.log" >&2; continue; }
  echo "   $((SECONDS - start)) s; $(grep -m1 '^advised row' "$OUT/$name.txt" || true)" >&2
  done_files+=("$OUT/$name.json")
done
[ ${#done_files[@]} -gt 0 ] || { echo "no command finished" >&2; exit 1; }
errors=()
if [ -n "${WRITE_ERRORS:-}" ]; then
  errors=(--write-errors megatron_pipemesh/planning/advice_error.json
          --source "scripts/advice_accuracy.sh (REPEATS=$REPEATS) on $(nproc) cores, $(date -u +%Y-%m-%d), $(git rev-parse --short HEAD): ${#done_files[@]} commands")
fi
.venv/bin/python -m megatron_pipemesh.bench.advice_ledger "${done_files[@]}" --json "$OUT/ledger.json" "${errors[@]}" \
  | tee "$OUT/ledger.md"
