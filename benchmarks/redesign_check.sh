#!/usr/bin/env bash
# Issue 23 (the engine redesign) on the GPU machine: the GPU tests, then `gpu_check.py
# --sections bench` of a base tree and of this tree, each with an empty Triton cache (so
# their start-ups compare), back to back in one lease.
#   bash benchmarks/redesign_check.sh tests|base|new
# base: a folder .abbase holding the base commit's pagedserve/ and benchmarks/
# (git archive COMMIT pagedserve benchmarks | tar -x -C .abbase); the stand-in tokenizer
# comes from .devtok/ (see docs/performance.md, "Serving on the H200").
set -uo pipefail
OUT="${OUT:-redesign_results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$PWD"
export PYTHONUNBUFFERED=1 PS_TOKENIZER="$ROOT/.devtok"
case "$1" in
tests)
    python3 -m pytest tests/gpu -rfE -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/gpu_tests.log" ;;
base|new)
    dir="$ROOT"; [ "$1" = base ] && dir="$ROOT/.abbase"
    mkdir -p "$OUT/$1"
    (cd "$dir" && TRITON_CACHE_DIR="/tmp/triton_$1" OUT="$OUT/$1" PYTHONPATH=. \
        timeout 560 python3 benchmarks/gpu_check.py --sections bench > "$OUT/$1/bench.log" 2>&1)
    grep -E "^(qwen3|nanbeige)" "$OUT/$1/bench.log" || tail -20 "$OUT/$1/bench.log"
    tar czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -r "${OUT:?}/$1" ;;
esac
