#!/usr/bin/env bash
# Structured output on the GPU machine (issue 24), in one device call:
#   bash benchmarks/structured_check.sh
# 1. tests/gpu/test_structured_gpu.py (constrained rows among free ones, graph steps);
# 2. one `pagedserve serve` of the Qwen3-4B preset (dummy weights, bf16), measured by
#    `pagedserve bench serve` (1,024 token-id prompt tokens in, 128 out, streaming completions):
#    free vs every request under benchmarks/schemas/catalogue.json at concurrency 64, and the
#    first-token latency of a cached schema vs a new schema per request (concurrency 1 and 64).
#    ROUNDS (3) rounds of free and schema runs of PROMPTS (512) prompts each; PYSPY=1 records
#    a py-spy profile of the server's processes during the last schema run (which it slows).
# The GPU machine has no network: fastapi, pydantic, pyzmq, xgrammar, ... come as wheels in
# .whl/ (pip download ... --python-version 3.12, see docs/performance.md), the stand-in
# tokenizer from .devtok/. Results go to $OUT (or ./structured_results).
set -uo pipefail
OUT="${OUT:-structured_results}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER=.devtok
python3 -m pytest -rA -p no:cacheprovider tests/gpu/test_engine_gpu.py tests/gpu/test_structured_gpu.py \
    > "$OUT/pytest.log" 2>&1
PORT=8000
PAGEDSERVE_STEP_TIMES=200 python3 -m pagedserve.cli serve qwen3-4b-instruct-2507 --load-format dummy --tokenizer .devtok \
    --port $PORT --log-level INFO --disable-log-requests > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
BENCH="python3 -m pagedserve.cli bench serve --base-url http://127.0.0.1:$PORT --no-progress --temperature 0 --input-len 1024 --output-len 128"
run() {  # name, then bench flags
    echo "=== $1 ==="
    local name="$1"; shift
    $BENCH "$@" --save-result "$OUT/structured_$name.json" 2>&1 | grep -E "throughput|TTFT|TPOT|completed|errors"
}
SCHEMA=benchmarks/schemas/catalogue.json
# Every run has prompts of its own (--seed): a run that repeated another's would hit the
# prefix cache.
# What one schema output looks like (dummy weights write garbage inside the strings)
curl -s http://127.0.0.1:$PORT/v1/completions -H 'Content-Type: application/json' -d "{\"model\": \"qwen3-4b-instruct-2507\",
    \"prompt\": \"A catalogue:\", \"max_tokens\": 128, \"temperature\": 0,
    \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"c\", \"schema\": $(cat $SCHEMA)}}}" \
    > "$OUT/sample.json"
head -c 600 "$OUT/sample.json"; echo
ROUNDS="${ROUNDS:-3}"; PROMPTS="${PROMPTS:-512}"
for round in $(seq "$ROUNDS"); do  # rounds, alternating, so drift shows
    run free_c64_r$round --max-concurrency 64 --num-prompts "$PROMPTS" --warmup 8 --seed $((10 * round))
    if [ "${PYSPY:-0}" = 1 ] && [ "$round" = "$ROUNDS" ]; then  # where the engine core's host time goes
        python3 -m pip install -q --no-index --find-links .whl --target /tmp/pyspy py-spy
        /tmp/pyspy/bin/py-spy record --subprocesses --native --pid "$SERVER" --rate 100 --duration 8 \
            --format raw -o "$OUT/pyspy_schema.txt" > /dev/null 2>&1 &
    fi
    run schema_c64_r$round --max-concurrency 64 --num-prompts "$PROMPTS" --warmup 8 --seed $((10 * round + 1)) --json-schema $SCHEMA
done
if [ -s "$OUT/pyspy_schema.txt" ]; then
    python3 benchmarks/pyspy_summary.py "$OUT/pyspy_schema.txt" --top 25 > "$OUT/pyspy_summary.txt"
    grep -A30 "engine" "$OUT/pyspy_summary.txt" | head -40
fi
run cached_c1 --max-concurrency 1 --num-prompts 32 --warmup 2 --json-schema $SCHEMA --seed 5
run unique_c1 --max-concurrency 1 --num-prompts 32 --warmup 2 --json-schema $SCHEMA --unique-schemas --seed 6
run free_c1 --max-concurrency 1 --num-prompts 32 --warmup 2 --seed 7
run unique_c64 --max-concurrency 64 --num-prompts 256 --warmup 8 --json-schema $SCHEMA --unique-schemas --seed 8
kill -TERM $SERVER; wait $SERVER
grep "host ms per step" "$OUT/server.log" | tail -12 | cut -c1-400
tail -5 "$OUT/server.log"
grep -E "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/pytest.log" | tail -20
python3 - "$OUT" <<'PY'
import json, sys, glob, os
print(f"{'run':<22} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'failed':>6}")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "structured_*.json"))):
    r = json.load(open(f))["runs"][0]
    print(f"{os.path.basename(f)[11:-5]:<22} {r['output_throughput']:>10.0f} {r['ttft_ms']['median']:>9.1f} "
          f"{r['ttft_ms']['p99']:>9.1f} {r['tpot_ms']['median']:>9.2f} {r['failed']:>6}")
PY
