#!/usr/bin/env bash
# Launch mlx-vlm's OpenAI-compatible server (continuous batching; /v1/chat/completions only, no
# /v1/completions) on a folder written by mlx_vlm_convert.py.
#   bash benchmarks/peers/mlx_vlm_server.sh MODEL_DIR PORT [extra mlx_vlm.server flags...]
# The model id in requests is MODEL_DIR exactly as given here. Set MLX_VENV to use another venv
# (default data/venvs/mlx, made by setup_mlx_vlm.sh). exec: the server gets this script's PID, so
# `kill PID` stops it.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 MODEL_DIR PORT [extra mlx_vlm.server flags]" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${MLX_VENV:-$ROOT/data/venvs/mlx}"
MODEL="$1"
PORT="$2"
shift 2
if [ ! -f "$MODEL/config.json" ] || ! grep -q '"compress_ratios"' "$MODEL/config.json"; then
    echo "$MODEL is not an mlx-vlm DeepSeek-V4 folder; run benchmarks/peers/mlx_vlm_convert.py first" >&2
    exit 2
fi
# Offline: never reach for the hub (the model is local).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$VENV/bin/python" -m mlx_vlm.server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --log-level WARNING "$@"
