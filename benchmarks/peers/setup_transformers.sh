#!/usr/bin/env bash
# Creates the virtualenv for the transformers peer (benchmarks/peers/transformers_server.py).
#   bash benchmarks/peers/setup_transformers.sh [VENV_DIR]      (default: data/venvs/transformers)
# torch is installed FIRST, pinned to the CPU build: an open torch requirement (transformers pulls
# one) would otherwise fetch a multi-GB CUDA build.
# `transformers serve` needs the [serving] extra (openai, rich, ...) and accelerate (the extra pulls
# it; without it loading fails: "Using a `device_map` ... requires `accelerate`"). fastapi/uvicorn
# also serve the --backend wrapper.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/data/venvs/transformers}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "transformers[serving]==5.23.0" accelerate fastapi uvicorn safetensors
"$VENV/bin/python" -c "import torch, transformers as t; print('torch', torch.__version__, 'transformers', t.__version__)"
echo "venv ready: $VENV"
echo "launch:  $VENV/bin/python $ROOT/benchmarks/peers/transformers_server.py --model MODEL_DIR --port 8101"
echo "         (add --backend wrapper for the one-at-a-time FastAPI wrapper with ignore_eos)"
