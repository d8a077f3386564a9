#!/usr/bin/env bash
# GPT pretraining with Megatron-LM's pretrain_gpt.py on one 8-GPU node, tuned by Lagom.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron/pretrain_gpt_lagom.sh [online|offline]
#
# Unpatched installs go through the launcher (python -m lagom_megatron.run); after
# `lagom patch megatron --path "$MEGATRON_LM"` set LAUNCH=patched to run pretrain_gpt.py directly.
# Mock data and the null tokenizer keep it self-contained; swap in --data-path/--tokenizer-* for real runs.
# The checkout's megatron/ goes first on PYTHONPATH (the launcher also puts the script's directory first).
#
# Flash-Overlap (FLASH_OVERLAP=1, the default) decomposes the TP+SP points with megatron-core's own
# linears: --transformer-impl local and --no-gradient-accumulation-fusion. Megatron's local layers
# take sequence parallelism only with NVIDIA Apex installed (its fused LayerNorm; the torch LayerNorm
# fallback refuses --sequence-parallel), so this script checks for Apex first. FLASH_OVERLAP=0 keeps
# Transformer Engine's layers (no Apex needed); Lagom then tunes NCCL and the buckets only.
set -euo pipefail

: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (it has pretrain_gpt.py)}"
MODE="${1:-online}"
GPUS="${GPUS:-8}"
HARDWARE="${HARDWARE:-a100-8x-100g}"        # a preset (configs/hardware, LAGOM_HARDWARE_PATH) or a YAML file
OUT="$(realpath -m "${OUT:-out/megatron-gpt-lagom}")"
LAUNCH="${LAUNCH:-launcher}"
FLASH_OVERLAP="${FLASH_OVERLAP:-1}"

MODEL=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 64
  --tensor-model-parallel-size 2 --sequence-parallel --bf16
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --train-iters 200 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20
  --mock-data --tokenizer-type NullTokenizer --vocab-size 50257
  --log-interval 10 --tensorboard-dir "$OUT/tb"
)
# Plans Lagom makes and its report go to $OUT; the online cache to $OUT/cache.
LAGOM=(
  --lagom --lagom-mode "$MODE" --lagom-hardware "$HARDWARE" --lagom-tune-steps 60
  --lagom-report "$OUT" --lagom-out "$OUT" --lagom-cache-dir "$OUT/cache"
)
if [[ "$MODE" == offline && -f "$OUT/lagom-plan.json" ]]; then
  LAGOM+=(--lagom-plan "$OUT/lagom-plan.json")   # the plan an earlier run wrote: start from it (read only)
fi

if [[ "$FLASH_OVERLAP" == 1 ]]; then
  if ! python -c "import apex.normalization" 2>/dev/null; then
    echo "Flash-Overlap here needs megatron-core's local layers, which need NVIDIA Apex for --sequence-parallel;" >&2
    echo "install Apex (https://github.com/NVIDIA/apex), or run with FLASH_OVERLAP=0 to keep Transformer Engine's layers." >&2
    exit 1
  fi
  MODEL+=(--transformer-impl local --no-gradient-accumulation-fusion)
  LAGOM+=(--lagom-flash-overlap)
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
if [[ "$LAUNCH" == patched ]]; then
  ENTRY=("$MEGATRON_LM/pretrain_gpt.py")
else
  ENTRY=(-m lagom_megatron.run "$MEGATRON_LM/pretrain_gpt.py")
fi
PYTHONPATH="$MEGATRON_LM:${PYTHONPATH:-}" torchrun --standalone --nproc-per-node "$GPUS" \
  "${ENTRY[@]}" "${MODEL[@]}" "${LAGOM[@]}"
