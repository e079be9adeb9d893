#!/usr/bin/env bash
# Wall time of `pipemesh plan --megatron-args` advices, complete (--search-seconds 0), at each --jobs given (default: 1
# and 2), with the user and system CPU seconds of the command and its workers. Run it on an idle machine: the numbers are
# docs/launching.md's timing table. SECONDS_LIMIT=60 times the default answer instead (the search's deadline).
#   bash scripts/advice_speed.sh                 # every command, --jobs 1 then 2
#   bash scripts/advice_speed.sh 2               # --jobs 2 only
#   ONLY=llama-70b bash scripts/advice_speed.sh  # one command (1.3b, 1.3b-a100, llama-8b, 70b or llama-70b)
set -euo pipefail
cd "$(dirname "$0")/.."
PIPEMESH=${PIPEMESH:-.venv/bin/pipemesh}
if [ $# -gt 0 ]; then JOBS=("$@"); else JOBS=(1 2); fi
# README "What should I run?": GPT-1.3B TP1 PP4 DP4 on 16 single-GPU A10G VMs at 6.25 Gbit/s, 48 GiB host memory.
GPT_1_3B=(--nodes 16 --gpus-per-node 1 --nic-gbps 6.25 --gpu A10G --host-memory-gb 48
  --megatron-args "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 64 --bf16 --use-distributed-optimizer --pipeline-model-parallel-size 4 --transformer-impl local --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --train-iters 1000 --lr 1e-4")
# The same GPT-1.3B command on two 8-GPU A100 servers (NVLink inside, 100 Gbit/s between them): README's second advice.
GPT_1_3B_A100=(--nodes 2 --gpus-per-node 8 --nic-gbps 100 --intra-node-gbps 2400 --gpu A100 "${GPT_1_3B[@]:10}")
# GPT-70B (80 layers, hidden 8192, 64 heads in 8 query groups, SwiGLU FFN 28672, seq 4096, global batch 512,
# micro-batch 1, bf16, distributed optimizer) as TP8 PP8 V=2 on 32 nodes x 8 L40S at 100 Gbit/s, 64 GiB host memory.
GPT_70B=(--nodes 32 --gpus-per-node 8 --nic-gbps 100 --gpu L40S --host-memory-gb 64
  --megatron-args "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8 --ffn-hidden-size 28672 --swiglu --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 512 --bf16 --use-distributed-optimizer --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --train-iters 1000 --lr 1e-4")
# Llama-3-8B (32 layers, hidden 4096, GQA 8, SwiGLU FFN 14336, RMSNorm, RoPE, untied embeddings, no biases, seq 8192,
# vocabulary 128256) as TP4 PP2 at micro-batch 1, global batch 256 on 4 nodes x 8 H100 at 100 Gbit/s.
LLAMA_8B=(--nodes 4 --gpus-per-node 8 --gpu H100 --nic-gbps 100
  --megatron-args "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 256 --bf16 --use-distributed-optimizer --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --transformer-impl local --train-iters 1000 --lr 1e-4")
# The GPT-70B above as Llama-style users write it: RoPE, RMSNorm, untied embeddings, no biases, sequence parallelism,
# vocabulary 128256, V = 2 through --num-layers-per-virtual-pipeline-stage 5, the local layer spec.
LLAMA_70B=(--nodes 32 --gpus-per-node 8 --nic-gbps 100 --gpu L40S --host-memory-gb 64
  --megatron-args "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8 --ffn-hidden-size 28672 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --sequence-parallel --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 512 --bf16 --use-distributed-optimizer --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 5 --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --transformer-impl local --train-iters 1000 --lr 1e-4")
for jobs in "${JOBS[@]}"; do
  for name in 1.3b 1.3b-a100 llama-8b 70b llama-70b; do
    if [ -n "${ONLY:-}" ] && [ "$ONLY" != "$name" ]; then continue; fi
    case "$name" in
      1.3b) args=("${GPT_1_3B[@]}") ;;
      1.3b-a100) args=("${GPT_1_3B_A100[@]}") ;;
      llama-8b) args=("${LLAMA_8B[@]}") ;;
      70b) args=("${GPT_70B[@]}") ;;
      *) args=("${LLAMA_70B[@]}") ;;
    esac
    TIMEFORMAT="$name --jobs $jobs: %R s wall, %U s user + %S s system CPU"
    time "$PIPEMESH" plan --quiet --jobs "$jobs" --search-seconds "${SECONDS_LIMIT:-0}" "${args[@]}" \
      | sed -n '2p;5,9p;/^note: the layout search/p'
  done
done
