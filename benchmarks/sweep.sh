#!/usr/bin/env bash
# Regenerates docs/results/sweep.{json,md} and the plots: aggregated vs pull vs push on one
# random-weight Qwen3 checkpoint, request rate x prompt length, fp32 (as published and as the
# simulator's validation assumes). About 15 minutes on 2 cores.
# The checkpoint is written by our own tool (deterministic: fixed seed) into a temp dir.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . "${DISAGG_VENV:-.venv}/bin/activate"
MODEL="${MODEL:-$(mktemp -d)/sweep-qwen3}"
OUT="${OUT:-docs/results}"
[ -f "$MODEL/config.json" ] || disagg make-model --arch qwen3 --layers 2 --hidden 128 --heads 4 \
  --kv-heads 4 --head-dim 64 --intermediate 256 --vocab 4096 --max-pos 16384 --seed 0 \
  --out "$MODEL" >/dev/null
disagg bench sweep --model "$MODEL" --modes aggregated,pull,pull-inline,push \
  --request-rates "${RATES:-0.5,1.5,3}" --input-lens "${LENS:-256,1024,4096}" --output-len 32 \
  --num-prompts "${PROMPTS:-20}" --warmup 3 --token-range 100:4000 --seed 0 \
  --output-dir "$OUT" --log-dir "$(mktemp -d)" \
  --up-args="-- --num-blocks 8192 --max-num-batched-tokens 4096 --max-model-len 8192 --dtype float32"
