#!/usr/bin/env bash
# The embedded default: set up .venv, tokenize the shipped corpus into Megatron's indexed format,
# and pretrain a tiny GPT on CPU with 2 ranks (gloo, PP=2, VP=2) under the PipeMesh schedule.
# Extra arguments are passed to Megatron (e.g. --train-iters 100, or --pipeline-schedule default
# to compare against stock Megatron). NPROC and RUN_DIR may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
RUN_DIR=${RUN_DIR:-runs/demo}
NPROC=${NPROC:-2}
mkdir -p "$RUN_DIR"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
if [ ! -f "$RUN_DIR/corpus.idx" ]; then
  .venv/bin/python -m megatron_pipemesh.data.prepare --input megatron_pipemesh/data/corpus --output-prefix "$RUN_DIR/corpus"
fi
schedule=(--pipeline-schedule pipemesh --forward-groups 6 2 --backward-groups 4 4)
for arg in "$@"; do
  if [ "$arg" = "--pipeline-schedule" ]; then schedule=(); fi
done
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" scripts/pretrain_gpt.py \
  --data-path "$RUN_DIR/corpus" --tokenizer-type NullTokenizer --vocab-size 257 --split 98,1,1 \
  --data-cache-path "$RUN_DIR/cache" \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 4 --global-batch-size 32 \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
  --train-iters 40 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 4 --weight-decay 0.01 \
  --clip-grad 1.0 --log-interval 5 --eval-interval 20 --eval-iters 2 --seed 1234 --num-workers 0 \
  "${schedule[@]}" "$@"
