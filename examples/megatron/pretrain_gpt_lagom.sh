#!/usr/bin/env bash
# GPT pretraining with Megatron-LM's pretrain_gpt.py on one 8-GPU node, tuned by Lagom.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron/pretrain_gpt_lagom.sh [online|offline]
#
# Unpatched installs go through the launcher (python -m lagom_megatron.run); after
# `lagom patch megatron` set LAUNCH=patched to run pretrain_gpt.py directly with the same flags.
# Mock data and the null tokenizer keep it self-contained; swap in --data-path/--tokenizer-* for real runs.
# The checkout's megatron/ goes first on PYTHONPATH; patch that one with `lagom patch megatron --path "$MEGATRON_LM"`.
set -euo pipefail

: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (it has pretrain_gpt.py)}"
MODE="${1:-online}"
GPUS="${GPUS:-8}"
HARDWARE="${HARDWARE:-a100-8x-100g}"        # a preset in configs/hardware or a YAML file
OUT="$(realpath -m "${OUT:-out/megatron-gpt-lagom}")"
LAUNCH="${LAUNCH:-launcher}"

MODEL=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 64
  --tensor-model-parallel-size 2 --sequence-parallel --bf16
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --train-iters 200 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20
  --mock-data --tokenizer-type NullTokenizer --vocab-size 50257
  --log-interval 10 --tensorboard-dir "$OUT/tb"
  # megatron-core's own linears (not Transformer Engine's), without fused wgrad accumulation, so the
  # TP+SP points the plan decomposes can run as Flash-Overlap; drop both to keep TE's layers.
  --transformer-impl local --no-gradient-accumulation-fusion
)
LAGOM=(
  --lagom --lagom-mode "$MODE" --lagom-hardware "$HARDWARE" --lagom-tune-iters 10
  --lagom-plan "$OUT/plan.json" --lagom-report "$OUT" --lagom-flash-overlap
)

export CUDA_DEVICE_MAX_CONNECTIONS=1
if [[ "$LAUNCH" == patched ]]; then
  ENTRY=("$MEGATRON_LM/pretrain_gpt.py")
else
  ENTRY=(-m lagom_megatron.run "$MEGATRON_LM/pretrain_gpt.py")
fi
PYTHONPATH="$MEGATRON_LM:${PYTHONPATH:-}" torchrun --standalone --nproc-per-node "$GPUS" \
  "${ENTRY[@]}" "${MODEL[@]}" "${LAGOM[@]}"
