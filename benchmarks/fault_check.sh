#!/usr/bin/env bash
# Issue 22 on the GPU machine, in one device call: the GPU fault tests (tests/gpu), decode
# latency A/B against a base tree (what the non-finite-logits check costs on the sampling
# path), and the fault recovery of a real server (benchmarks/fault_recovery.py).
#   BASE=.abbase bash benchmarks/fault_check.sh
# BASE: a folder holding the base commit's pagedserve/ (git archive COMMIT pagedserve | tar -x -C
# .abbase). The HTTP stack comes from wheels in .whl/, the stand-in tokenizer from .devtok/
# (see docs/performance.md, "Serving on the H200").
set -uo pipefail
OUT="${OUT:-fault_results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$PWD"
python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .whl/*.whl
export PYTHONUNBUFFERED=1
echo "=== tests/gpu ==="
python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
LAT="-m pagedserve.cli bench latency qwen3-4b-instruct-2507 --load-format dummy --tokenizer $ROOT/.devtok --batch-sizes 1,8,64 --steps 128"
for round in 1 2; do
    if [ -n "${BASE:-}" ]; then
        echo "=== latency, base, round $round ==="
        (cd "$BASE" && timeout 200 python3 $LAT --output-json "$OUT/lat_base_$round.json" > /tmp/lat_base_$round.log 2>&1)
        grep -E "^batch" /tmp/lat_base_$round.log || tail -5 /tmp/lat_base_$round.log
    fi
    echo "=== latency, this tree, round $round ==="
    timeout 200 python3 $LAT --output-json "$OUT/lat_new_$round.json" > /tmp/lat_new_$round.log 2>&1
    grep -E "^batch" /tmp/lat_new_$round.log || tail -5 /tmp/lat_new_$round.log
done
echo "=== fault recovery ==="
PYTHONPATH="$ROOT:/tmp/pydeps" timeout 240 python3 benchmarks/fault_recovery.py --out "$OUT/fault_recovery.json" 2>&1 | tail -3
tail -5 "$OUT/fault_recovery.server.log"
