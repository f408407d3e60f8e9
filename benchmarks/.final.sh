set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl > /dev/null 2>&1 || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER=.devtok
timeout 120 python3 benchmarks/grammar_fill.py --tokenizer .devtok --vocab-size 151936 2>&1 | grep -v -i warn > "$OUT/grammar_fill.txt"
PORT=8000
PAGEDSERVE_STEP_TIMES=200 python3 -m pagedserve.cli serve qwen3-4b-instruct-2507 --load-format dummy --tokenizer .devtok \
    --port $PORT --log-level INFO > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
BENCH="python3 -m pagedserve.cli bench serve --base-url http://127.0.0.1:$PORT --no-progress --input-len 1024 --output-len 128"
run() { local name="$1"; shift; echo "=== $name" >> "$OUT/server.log"; $BENCH "$@" --save-result "$OUT/structured_$name.json" > /dev/null 2>&1; }
run free_c64 --max-concurrency 64 --num-prompts 256 --warmup 8 --seed 50
run schema_c64 --max-concurrency 64 --num-prompts 256 --warmup 8 --seed 51 --json-schema benchmarks/schemas/catalogue.json
run free_c64_b --max-concurrency 64 --num-prompts 256 --warmup 8 --seed 52
run schema_c64_b --max-concurrency 64 --num-prompts 256 --warmup 8 --seed 53 --json-schema benchmarks/schemas/catalogue.json
kill -TERM $SERVER; wait $SERVER
grep -E "^===|host ms per step" "$OUT/server.log" | sed 's/.*engine-core: //' | cut -c1-330 | tail -24
cat "$OUT/grammar_fill.txt"
python3 - "$OUT" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "structured_*.json"))):
    r = json.load(open(f))["runs"][0]
    print(f"{os.path.basename(f)[11:-5]:<22} {r['output_throughput']:>10.0f} {r['ttft_ms']['median']:>9.1f} {r['ttft_ms']['p99']:>9.1f} {r['tpot_ms']['median']:>9.2f} {r['failed']:>6}")
PY
