#!/usr/bin/env bash
# Serving benchmarks on the GPU machine (issue 6), one device call per part:
#   bash benchmarks/serve_check.sh ours   # pagedserve: vLLM's sweep, short chats, prefix caching on/off
#   NAME=b2048 SERVE_ARGS="--max-num-batched-tokens 2048" bash benchmarks/serve_check.sh sweep
#     (LEVELS=64,256 PROMPTS=256,1024 for some levels only)
#   bash benchmarks/serve_check.sh hf     # the Transformers baselines (--engine hf, hf-batched)
#   LEVELS=3,5 bash benchmarks/serve_check.sh hf_short   # the wrapper benchmark on --engine hf alone
# Every server is started by `pagedserve bench serve --launch`, which records its start-up time
# and peak GPU memory. Results go to $OUT (or ./serve_results). The GPU machine has no network:
# the HTTP stack comes from wheels in .whl/ (see docs/performance.md) and the stand-in tokenizer
# from .devtok/ (SmolLM2's tokenizer files).
set -uo pipefail
PART="${1:-ours}"
OUT="${OUT:-serve_results}"
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --find-links .whl --target /tmp/pydeps \
        fastapi uvicorn uvloop httptools pyzmq prometheus-client httpx nvidia-ml-py opentelemetry-api tqdm psutil rich
fi
export PYTHONPATH="$PWD:/tmp/pydeps"
MODEL="${MODEL:-qwen3-4b-instruct-2507}"
PORT=8000
SERVE="python3 -m pagedserve.cli serve $MODEL --load-format dummy --tokenizer .devtok --port $PORT --log-level WARNING ${SERVE_ARGS:-}"
BENCH="python3 -m pagedserve.cli bench serve --base-url http://127.0.0.1:$PORT --no-progress --temperature 0"
tag="$(echo "$MODEL" | cut -d- -f1)"

run() {  # name, then bench flags
    local name="$1"; shift
    echo "=== $name ==="
    $BENCH "$@" --save-result "$OUT/serve_${tag}_${name}.json" 2>&1 | grep -v '^{' | tail -40
}

if [ "$PART" = "sweep" ]; then  # NAME=... SERVE_ARGS=... to compare server settings
    PAGEDSERVE_SLOW_STEP_MS=250 run "${NAME:-pagedserve}" --launch "$SERVE --log-level INFO" --launch-log "$OUT/server_${NAME:-sweep}.log" --label pagedserve --input-len 1024 --output-len 128 \
        --concurrency-sweep "${LEVELS:-1,16,64,256}" --num-prompts-per-level "${PROMPTS:-32,64,256,1024}" --warmup 4
elif [ "$PART" = "ours" ]; then
    run pagedserve --launch "$SERVE --log-level INFO" --launch-log "$OUT/server_sweep.log" --label pagedserve --input-len 1024 --output-len 128 \
        --concurrency-sweep 1,16,64,256 --num-prompts-per-level 32,64,256,1024 --warmup 4
    run pagedserve_short --launch "$SERVE" --label pagedserve --dataset short --endpoint chat --ignore-eos \
        --output-len 100 --concurrency-sweep 1,3,5,10 --num-prompts 15 --warmup 2
    run pagedserve_prefix_on --launch "$SERVE" --label "prefix caching on" --dataset prefix --ignore-eos \
        --prefix-len 1536 --input-len 2048 --output-len 64 --num-prefixes 4 --num-prompts 256 \
        --max-concurrency 32 --warmup 0
    run pagedserve_prefix_off --launch "$SERVE --no-enable-prefix-caching" --label "prefix caching off" \
        --dataset prefix --ignore-eos --prefix-len 1536 --input-len 2048 --output-len 64 --num-prefixes 4 \
        --num-prompts 256 --max-concurrency 32 --warmup 0
elif [ "$PART" = "short" ]; then  # the wrapper benchmark alone
    run pagedserve_short --launch "$SERVE" --label pagedserve --dataset short --endpoint chat --ignore-eos \
        --output-len 100 --concurrency-sweep 1,3,5,10 --num-prompts 15 --warmup 2
elif [ "$PART" = "diag" ]; then  # slow steps and a py-spy profile of the server's processes
    python3 -m pip install -q --no-index --find-links .whl --target /tmp/pyspy py-spy
    export PAGEDSERVE_SLOW_STEP_MS=250
    $SERVE --log-level INFO > "$OUT/server_diag.log" 2>&1 &
    SERVER_PID=$!
    until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health')" 2>/dev/null; do sleep 0.5; done
    /tmp/pyspy/bin/py-spy record --subprocesses --pid "$SERVER_PID" --rate 200 --duration 45 \
        --format raw -o "$OUT/pyspy_raw.txt" > "$OUT/pyspy.log" 2>&1 &
    SPY=$!
    sleep 2
    run diag --label diag --input-len 1024 --output-len 128 --concurrency-sweep 16,16,256 \
        --num-prompts-per-level 64,64,1024 --warmup 4
    wait "$SPY"
    kill -INT "$SERVER_PID"; wait "$SERVER_PID"
    python3 benchmarks/pyspy_summary.py "$OUT/pyspy_raw.txt" --top 30 > "$OUT/pyspy_summary.txt"
elif [ "$PART" = "hf" ]; then
    run hf_batched --launch "$SERVE --engine hf-batched --max-num-seqs 256" --label "hf-batched" \
        --input-len 1024 --output-len 128 --concurrency-sweep 1,16,64,256 \
        --num-prompts-per-level 4,32,64,256 --warmup 1
    run hf --launch "$SERVE --engine hf" --label "hf (naive)" --input-len 1024 --output-len 128 \
        --concurrency-sweep 1,16 --num-prompts-per-level 4,16 --warmup 1
    run hf_short --launch "$SERVE --engine hf" --label "hf (naive)" --dataset short --endpoint chat --ignore-eos \
        --output-len 100 --concurrency-sweep 1,3,5,10 --num-prompts 15 --warmup 1
elif [ "$PART" = "hf_short" ]; then  # the wrapper benchmark alone, at the levels in $LEVELS
    run hf_short --launch "$SERVE --engine hf" --label "hf (naive)" --dataset short --endpoint chat --ignore-eos \
        --output-len 100 --concurrency-sweep "${LEVELS:-1,3,5,10}" --num-prompts 15 --warmup 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "done: $(ls "$OUT")"
