#!/usr/bin/env bash
# Launch llama.cpp's llama-server (built by setup_llama_cpp.sh) on a GGUF written by llama_cpp_convert.py.
#   bash benchmarks/peers/llama_cpp_server.sh MODEL.gguf PORT [extra llama-server flags...]
# Serves /v1/chat/completions (and /v1/completions) with continuous batching over PARALLEL slots
# (default 64) sharing one unified KV cache of CTX tokens (default 32768), on THREADS CPU threads for
# decode and batch work alike (default 1; run_peers.py passes its --threads). The chat template is the
# checkpoint's, run by llama-server's Jinja engine (--jinja). Any model id is accepted in requests; it
# answers as the GGUF's file name without .gguf (--alias). Set LLAMA_CPP_DIR to use another build
# (default benchmarks/peers/build/llama.cpp). exec: the server gets this script's PID, so `kill PID` stops it.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 MODEL.gguf PORT [extra llama-server flags]" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${LLAMA_CPP_DIR:-$ROOT/benchmarks/peers/build/llama.cpp}/bin/llama-server"
MODEL="$1"
PORT="$2"
shift 2
if [ ! -x "$BIN" ]; then
    echo "$BIN not found: run benchmarks/peers/setup_llama_cpp.sh first" >&2
    exit 2
fi
if [ ! -f "$MODEL" ]; then
    echo "$MODEL not found: write it with benchmarks/peers/llama_cpp_convert.py" >&2
    exit 2
fi
THREADS="${THREADS:-1}"
exec "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$PORT" --alias "$(basename "$MODEL" .gguf)" \
    --threads "$THREADS" --threads-batch "$THREADS" --parallel "${PARALLEL:-64}" --kv-unified \
    --ctx-size "${CTX:-32768}" --jinja --no-webui "$@"
