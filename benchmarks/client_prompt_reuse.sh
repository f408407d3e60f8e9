#!/usr/bin/env bash
# Which prompts each benchmark client re-sends across the levels of a sweep, read off the
# server's prefix-cache counters (issue 30: the two clients' TTFT at concurrency 16).
#   VLLM_PY=/path/to/python-with-vllm bash benchmarks/client_prompt_reuse.sh
# One pagedserve server (the embedded SmolLM2 on the CPU, prefix caching on, as by default);
# vLLM's `bench serve` (random dataset, 256 in / 4 out) at concurrency 1 with 8 prompts, then
# concurrency 4 with 32 prompts with the same --seed, then with another; pagedserve's `bench
# serve` sweeping the same two levels. Prints the prefix-cache hits after each (tokens).
set -u
VLLM_PY="${VLLM_PY:?a python with vLLM 0.26 installed (vllm bench serve)}"
PORT="${PORT:-8124}"
PS=".venv/bin/pagedserve"; [ -x "$PS" ] || PS="pagedserve"
TOK=$(python3 -c "from pagedserve.models.default_model import default_model_dir; print(default_model_dir())" 2>/dev/null \
      || .venv/bin/python -c "from pagedserve.models.default_model import default_model_dir; print(default_model_dir())")
$PS serve --port "$PORT" > /tmp/client_prompt_reuse_server.log 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null' EXIT
for _ in $(seq 240); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
hits() { curl -s "localhost:$PORT/metrics" | awk '/^vllm:prefix_cache_hits_total/ {printf "prefix-cache hits so far: %d tokens\n", $2}'; }
MODEL=$(curl -s "localhost:$PORT/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
V() {
    echo "vllm bench serve $*"
    "$VLLM_PY" -m vllm.entrypoints.cli.main bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
        --model "$MODEL" --tokenizer "$TOK" --dataset-name random --random-input-len 256 --random-output-len 4 \
        --ignore-eos --disable-tqdm "$@" 2>&1 | grep -E "Successful requests|Median TTFT"
    hits
}
hits
V --max-concurrency 1 --num-prompts 8 --seed 0
V --max-concurrency 4 --num-prompts 32 --seed 0
V --max-concurrency 4 --num-prompts 32 --seed 4
echo "pagedserve bench serve --concurrency-sweep 1,4 --num-prompts-per-level 8,32 --seed 0"
$PS bench serve --port "$PORT" --dataset random --input-len 256 --output-len 4 --ignore-eos --no-progress --temperature 0 \
    --concurrency-sweep 1,4 --num-prompts-per-level 8,32 --warmup 0 2>&1 | grep -E "TTFT"
hits
