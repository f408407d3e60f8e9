#!/usr/bin/env bash
# Where an offline workload's GPU time goes, per engine variant, in one device call:
#   VARIANTS="bf16 fp8" bash benchmarks/step_profile.sh
# Each variant runs `pagedserve bench throughput` (Qwen3-4B preset, dummy weights; NUM prompts
# of IN random tokens, OUT out; default 256 x 1,024 / 128, the shape of issue 5's serving
# table) with a step trace ($PAGEDSERVE_STEP_TRACE), summed up by benchmarks/step_trace_summary.py:
# busy time by step kind (decode only, decode + prefill, prefill only) and a fit of step time
# against its make-up. Variants: bf16, fp8 (--quantization fp8), fp8kv (fp8 + --kv-cache-dtype
# fp8); a trailing "t" (bf16t, fp8t) samples top-k / top-p with torch instead of the kernel
# ($PAGEDSERVE_TOP_K_TOP_P_KERNEL=0). EXTRA passes more engine flags to all. MODE=serve instead
# starts `pagedserve serve` per variant and measures it with `pagedserve bench serve` (IN /
# OUTLEN tokens) at each level of CONCURRENCY (default "16 64"), the trace cut into one segment
# per level; greedy, or the model's sampling defaults with SAMPLING=defaults.
# Results: $OUT/step_profile.tgz.
set -uo pipefail
OUT="${OUT:-step_profile_results}"
VARIANTS="${VARIANTS:-bf16 fp8}"
NUM="${NUM:-256}" IN="${IN:-1024}" OUTLEN="${OUTLEN:-128}" EXTRA="${EXTRA:-}"
mkdir -p "$OUT/p"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER="$PWD/.devtok"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/p/gpu.txt"
sampling="--temperature 0"
[ "${SAMPLING:-greedy}" = defaults ] && sampling=""
for v in $VARIANTS; do
    export PAGEDSERVE_TOP_K_TOP_P_KERNEL=1
    case $v in *t) export PAGEDSERVE_TOP_K_TOP_P_KERNEL=0 ;; esac
    case ${v%t} in
    bf16) flags="" ;; fp8) flags="--quantization fp8" ;; fp8kv) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
    *) echo "unknown variant $v"; continue ;;
    esac
    if [ "${MODE:-offline}" = serve ]; then
        PAGEDSERVE_STEP_TRACE="$OUT/p/trace_$v.jsonl" python3 -m pagedserve.cli serve qwen3-4b-instruct-2507 \
            --load-format dummy --tokenizer .devtok $flags $EXTRA --port 8000 > "$OUT/p/server_$v.log" 2>&1 &
        server=$!
        for _ in $(seq 300); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
        for c in ${CONCURRENCY:-16 64}; do
            python3 -m pagedserve.cli bench serve --base-url http://127.0.0.1:8000 --no-progress $sampling --input-len "$IN" \
                --output-len "$OUTLEN" --max-concurrency $c --num-prompts $((c * 4)) --warmup 8 --seed $((c + 3)) \
                --save-result "$OUT/p/serve_${v}_c$c.json" > "$OUT/p/serve_${v}_c$c.log" 2>&1
            python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print('$v c$c out tok/s %.0f TTFT p50 %.1f TPOT p50 %.2f failed %d' % (r['output_throughput'], r['ttft_ms']['median'], r['tpot_ms']['median'], r['failed']))" "$OUT/p/serve_${v}_c$c.json" || tail -3 "$OUT/p/serve_${v}_c$c.log"
            sleep 2  # (an idle gap: the trace's segments are the levels)
        done
        kill -TERM $server; wait $server
        python3 benchmarks/step_trace_summary.py "$OUT/p/trace_$v.jsonl" --json "$OUT/p/summary_$v.json" 2>&1 | tail -40
        gzip -f "$OUT/p/trace_$v.jsonl"; tar -C "$OUT" -czf "$OUT/step_profile.tgz" p
        continue
    fi
    PAGEDSERVE_STEP_TRACE="$OUT/p/trace_$v.jsonl" python3 -m pagedserve.cli bench throughput qwen3-4b-instruct-2507 \
        --load-format dummy --tokenizer .devtok --dtype bfloat16 $flags --num-prompts "$NUM" --input-len "$IN" \
        --output-len "$OUTLEN" --dataset-name random --disable-tqdm $EXTRA \
        --output-json "$OUT/p/throughput_$v.json" > "$OUT/p/throughput_$v.log" 2>&1
    echo "=== $v: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('out tok/s', d['output_tokens_per_s'], 'elapsed', d['elapsed_s'], 'roofline eff', d['roofline_efficiency'])" "$OUT/p/throughput_$v.json" 2>&1 || tail -3 "$OUT/p/throughput_$v.log")"
    grep -h "matmul plan for" "$OUT/p/throughput_$v.log" | head -20
    python3 benchmarks/step_trace_summary.py "$OUT/p/trace_$v.jsonl" --json "$OUT/p/summary_$v.json" 2>&1 | tail -40
    gzip -f "$OUT/p/trace_$v.jsonl"
    tar -C "$OUT" -czf "$OUT/step_profile.tgz" p
done
