#!/usr/bin/env bash
# Creates the virtualenv for the mlx-vlm peer (MLX CPU build).
#   bash benchmarks/peers/setup_mlx_vlm.sh [VENV_DIR]      (default: data/venvs/mlx)
# Both `mlx` and its CPU backend (`mlx[cpu]` pulls `mlx-cpu`) are needed on Linux without a GPU.
# mlx-lm has no deepseek_v4 model; mlx-vlm 0.7.10 has one (text-only use).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/data/venvs/mlx}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "mlx[cpu]==0.32.4" "mlx-vlm==0.7.10"
"$VENV/bin/python" -c "import mlx.core as mx, mlx_vlm; print('mlx', mx.__version__, mx.default_device())"
echo "venv ready: $VENV"
echo "convert: $VENV/bin/python $ROOT/benchmarks/peers/mlx_vlm_convert.py SRC_CHECKPOINT DST_DIR"
echo "launch:  bash $ROOT/benchmarks/peers/mlx_vlm_server.sh DST_DIR 8102"
