#!/usr/bin/env bash
# pagedserve --quantization fp8 against vLLM 0.26 --quantization fp8 on the GPU machine, back to
# back in one call, both measured by vLLM's own client (`vllm bench serve`, random 1,024 in /
# 128 out, --ignore-eos, 32/64/256/1,024 prompts at concurrency 1/16/64/256), Qwen3-4B preset
# with dummy weights. vLLM comes from ../shared/tools/vllm-carry.sh: pieces a and b already
# copied to /root/keep by the previous call, piece c and the wheels carried with this one:
#   VLLM_DIR=.carry/vllm bash benchmarks/vllm_fp8_compare.sh
# ENGINES (default "vllm pagedserve"): add pagedserve_kv8 for pagedserve with --kv-cache-dtype
# fp8 as well; vllm_bf16 and pagedserve_bf16 serve without quantization; a pagedserve name ending
# in _bN (pagedserve_bf16_b16384) serves with --max-num-batched-tokens N. A later call on the same
# machine finds vLLM unpacked and carries nothing of it.
# Results (vLLM's result JSON per run and a table) go to $OUT (or ./compare_results).
set -uo pipefail
OUT="${OUT:-compare_results}"
ENGINES="${ENGINES:-vllm pagedserve}"
mkdir -p "$OUT" /tmp/qwen3
source benchmarks/vllm_env.sh || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
cp pagedserve/models/presets/qwen3-4b-instruct-2507.json /tmp/qwen3/config.json
# the model's sampling defaults (temperature 0.7, top_k 20, top_p 0.8), which pagedserve's preset
# applies: without them vLLM samples at temperature 1 alone, a cheaper step than top-k + top-p
cp pagedserve/models/presets/qwen3-4b-instruct-2507.generation_config.json /tmp/qwen3/generation_config.json
PORT=8000
wait_ready() { for _ in $(seq 400); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && return 0; sleep 1; done; return 1; }
bench() {  # engine name, served model id
    for c in 1 16 64 256; do
        n=$(( c == 1 ? 32 : c == 16 ? 64 : c == 64 ? 256 : 1024 ))
        $VLLM bench serve --backend openai --base-url http://127.0.0.1:$PORT --model "$2" \
            --tokenizer .devtok --dataset-name random --random-input-len 1024 --random-output-len 128 \
            --num-prompts $n --max-concurrency $c --ignore-eos --seed $c --save-result \
            --result-dir "$OUT" --result-filename "$1_c$c.json" > "$OUT/$1_c$c.log" 2>&1
        grep -E "Output token throughput|Median TTFT|Median TPOT|Failed" "$OUT/$1_c$c.log" | tr '\n' ' '; echo " <- $1 c$c"
    done
}
report() {  # the table so far, and every file in one archive (a cut-off call still returns both)
python3 - "$OUT" <<'PY'
import json, os, sys
print(f"{'engine':<24} {'c':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'failed':>6}")
engines = sorted({name.rsplit("_c", 1)[0] for name in os.listdir(sys.argv[1])
                  if name.endswith(".json") and "_c" in name})
for engine in engines:
    for c in (1, 16, 64, 256):
        path = os.path.join(sys.argv[1], f"{engine}_c{c}.json")
        if os.path.exists(path):
            r = json.load(open(path))
            print(f"{engine:<24} {c:>4} {r['output_throughput']:>10.0f} {r['median_ttft_ms']:>9.1f} "
                  f"{r['median_tpot_ms']:>9.2f} {r.get('failed', 0):>6}")
PY
tar -C "$OUT" -czf "$OUT/compare.tgz" --exclude compare.tgz .
}
for engine in $ENGINES; do
    t0=$(date +%s)
    q="--quantization fp8"; [[ $engine == *_bf16* ]] && q=""
    if [[ $engine == vllm* ]]; then
        $VLLM serve /tmp/qwen3 --load-format dummy --tokenizer .devtok $q --port $PORT \
            > "$OUT/vllm_server.log" 2>&1 &
    else
        kv=""; [ $engine = pagedserve_kv8 ] && kv="--kv-cache-dtype fp8"
        budget=""; [[ $engine =~ _b([0-9]+)$ ]] && budget="--max-num-batched-tokens ${BASH_REMATCH[1]}"
        env PYTHONPATH="$PWD:/tmp/pydeps" python3 -m pagedserve.cli serve qwen3-4b-instruct-2507 \
            --load-format dummy --tokenizer .devtok $q $kv $budget --port $PORT \
            > "$OUT/${engine}_server.log" 2>&1 &
    fi
    SERVER=$!
    wait_ready || { tail -20 "$OUT/${engine}_server.log"; kill $SERVER; continue; }
    echo "$engine ready after $(( $(date +%s) - t0 )) s"
    id=$(curl -s http://127.0.0.1:$PORT/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
    bench $engine "$id"
    kill -TERM $SERVER; wait $SERVER; sleep 3
    report > "$OUT/table.txt"
done
cat "$OUT/table.txt"
