#!/usr/bin/env bash
# One pagedserve server measured by both benchmark clients, back to back (issue 30: do
# `pagedserve bench serve` and `vllm bench serve` agree on the same server and workload?):
#   VLLM_DIR=.carry/vllm bash benchmarks/client_agreement.sh
# Each level (concurrency 1 / 16 / 64 / 256 with 32 / 64 / 256 / 1,024 prompts; random 1,024 in /
# 128 out, --ignore-eos, no warm-up requests, the server's sampling defaults) runs every client in
# CLIENTS, each with a seed of its own (so no run hits another's prompts in the prefix cache):
#   vllm             vllm bench serve: the random ids' text, tokenized by the server;
#   pagedserve_text  pagedserve bench serve --random-as-text: the same kind of prompts;
#   pagedserve       pagedserve bench serve: token ids (its default).
# vLLM comes from ../shared/tools/vllm-carry.sh (benchmarks/vllm_env.sh: pieces a and b copied to
# /root/keep by the previous call, piece c and the wheels carried with this one); without the
# vllm client (CLIENTS="pagedserve_text pagedserve") nothing of it is needed. MODEL and
# SERVE_FLAGS pick the server (default: the Qwen3-4B preset with dummy weights), TOKENIZER the
# tokenizer folder (default .devtok), LEVELS the concurrencies, ROUNDS (default 1) how many times
# each level runs every client (rounds after the first are named CLIENT_rN in the table: at 64
# and 256 the split between TTFT and TPOT moves from run to run). Results go to $OUT (or
# ./agreement_results): a table, and every result and log in agreement.tgz.
set -uo pipefail
OUT="${OUT:-agreement_results}"
CLIENTS="${CLIENTS:-vllm pagedserve_text pagedserve}"
MODEL="${MODEL:-qwen3-4b-instruct-2507}"
SERVE_FLAGS="${SERVE_FLAGS:---load-format dummy}"
TOKENIZER="${TOKENIZER:-.devtok}"
LEVELS="${LEVELS:-1 16 64 256}"
ROUNDS="${ROUNDS:-1}"
PORT="${PORT:-8000}"
mkdir -p "$OUT/r"
if [[ " $CLIENTS " == *" vllm "* ]]; then
    source benchmarks/vllm_env.sh || exit 1
fi
if command -v nvidia-smi > /dev/null && [ -d .whl ]; then  # the GPU machine: dependencies come as wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
    export PYTHONPATH="$PWD:/tmp/pydeps"
fi
PY="${PY:-python3}"
$PY -m pagedserve.cli serve "$MODEL" $SERVE_FLAGS --tokenizer "$TOKENIZER" --port "$PORT" \
    --disable-log-requests > "$OUT/r/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 400); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
id=$(curl -s "http://127.0.0.1:$PORT/v1/models" | $PY -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])") || exit 1
common="--base-url http://127.0.0.1:$PORT --model $id --dataset-name random --random-input-len 1024 --random-output-len 128 --ignore-eos"
report() {  # the table so far, and every file in one archive (a cut-off call keeps what ran)
    $PY - "$OUT/r" <<'PY'
import json, os, sys
print(f"{'client':<20} {'c':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'in tok':>8} {'failed':>6}")
for name in sorted(os.listdir(sys.argv[1])):
    if not name.endswith(".json"):
        continue
    client, c = name[:-5].rsplit("_c", 1)
    r = json.load(open(os.path.join(sys.argv[1], name)))
    if "runs" in r:  # pagedserve's layout
        run = r["runs"][0]
        row = (run["output_throughput"], run["ttft_ms"]["median"], run["tpot_ms"]["median"], run["input_tokens"], run["failed"])
    else:  # vLLM's
        row = (r["output_throughput"], r["median_ttft_ms"], r["median_tpot_ms"], r["total_input_tokens"], r.get("failed", 0))
    print(f"{client:<20} {int(c):>4} {row[0]:>10.0f} {row[1]:>9.1f} {row[2]:>9.2f} {row[3]:>8} {row[4]:>6}")
PY
    tar -C "$OUT" -czf "$OUT/agreement.tgz" r
}
i=0
for c in $LEVELS; do
    n=$(( c == 1 ? 32 : c == 16 ? 64 : c == 64 ? 256 : 4 * c ))
    for round in $(seq "$ROUNDS"); do
        for client in $CLIENTS; do
            i=$((i + 1))
            seed=$((1000 + i))
            name=$client; [ "$round" -gt 1 ] && name="${client}_r$round"
            res="$OUT/r/${name}_c$c.json"
            case $client in
            vllm) $VLLM bench serve --backend openai $common --tokenizer "$TOKENIZER" --num-prompts $n \
                      --max-concurrency $c --seed $seed --save-result --result-dir "$OUT/r" \
                      --result-filename "${name}_c$c.json" > "$OUT/r/${name}_c$c.log" 2>&1 ;;
            pagedserve_text) $PY -m pagedserve.cli bench serve $common --random-as-text --tokenizer "$TOKENIZER" \
                      --num-prompts $n --max-concurrency $c --num-warmups 0 --seed $seed --disable-tqdm \
                      --save-result "$res" > "$OUT/r/${name}_c$c.log" 2>&1 ;;
            pagedserve) $PY -m pagedserve.cli bench serve $common --num-prompts $n --max-concurrency $c \
                      --num-warmups 0 --seed $seed --disable-tqdm --save-result "$res" > "$OUT/r/${name}_c$c.log" 2>&1 ;;
            *) echo "unknown client $client"; continue ;;
            esac
            [ -f "$res" ] || tail -3 "$OUT/r/${name}_c$c.log"
        done
    done
    report > "$OUT/table.txt"
done
cat "$OUT/table.txt"
