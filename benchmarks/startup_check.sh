#!/usr/bin/env bash
# Start-up to ready of `pagedserve serve` (issue 30), in one device call:
#   bash benchmarks/startup_check.sh
# 1. `serve` with empty Triton and matmul-plan caches (the first start on a fresh machine, as
#    far as this machine allows: the operating system's file cache is warm after the wheel
#    install), then again with both filled, then with the plan timed again: seconds from the
#    command to the first /health 200, and the engine core's log lines with their times;
# 2. the warm start once more under py-spy (every process, idle time included), summarised
#    per process, so the seconds can be put on functions;
# 3. `python -X importtime` of the engine core's modules.
# MODEL (qwen3-4b-instruct-2507), TIMES (1: warm starts to time), BASE (a folder holding another
# tree's pagedserve package: its warm starts alternate with this one's), COMPILE=1 (then write
# the bytecode of every package, as a pip install does, and time warm and empty-cache starts
# again; with DROP_CACHES=1 the empty-cache start follows a drop of the operating system's page
# cache, where permitted, as on a fresh machine), PYSPY=0 (no profile). Results go to $OUT.
set -uo pipefail
OUT="${OUT:-startup_results}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER=.devtok
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/startup_triton_cache}"
export PAGEDSERVE_PLAN_CACHE="${PAGEDSERVE_PLAN_CACHE:-/tmp/startup_plan_cache}"
MODEL="${MODEL:-qwen3-4b-instruct-2507}"
PORT=8000
ROOT="$PWD"
SERVE=(python3 -m pagedserve.cli serve "$MODEL" --load-format dummy --tokenizer "$ROOT/.devtok" --port $PORT
       --log-level INFO --disable-log-requests)

wait_ready() {  # pid t0: seconds since t0 until /health answers 200 ("died" if the process ends first)
    local pid=$1 t0=$2
    for _ in $(seq 1200); do
        curl -sf http://127.0.0.1:$PORT/health > /dev/null && break
        kill -0 "$pid" 2> /dev/null || { echo "died"; return; }
        sleep 0.05
    done
    python3 -c "import time; print(round(time.time() - $t0, 2))"
}

start() {  # name: time one start of the package in $TREE (default: this tree), then stop it
    local name=$1 t0 tree
    tree=$(cd "${TREE:-$ROOT}" && pwd)
    t0=$(date +%s.%N)
    (cd "$tree" && PYTHONPATH="$tree:/tmp/pydeps" exec "${SERVE[@]}") > "$OUT/serve_$name.log" 2>&1 &
    local pid=$!
    local s; s=$(wait_ready $pid "$t0")
    echo "$name: ready in $s s" | tee -a "$OUT/summary.txt"
    kill -TERM $pid; wait $pid
}

rm -rf "$TRITON_CACHE_DIR" "$PAGEDSERVE_PLAN_CACHE"
start cold
for i in $(seq "${TIMES:-1}"); do start "warm$i"; done
PAGEDSERVE_PLAN_CACHE=0 start warm_replan  # the Triton cache filled, the matmul plan timed again
if [ -n "${BASE:-}" ]; then  # another tree's pagedserve package (e.g. `git archive REV pagedserve`)
    # against this one, both with the Triton cache filled, alternated
    TREE="$BASE" start base_warm1
    start warm_again
    TREE="$BASE" start base_warm2
fi
if [ "${COMPILE:-0}" = 1 ]; then
    # The GPU image ships its packages without bytecode and runs Python with -B, so every
    # process compiles torch's modules from source: a pip install (what users have) writes
    # the bytecode once. Compile it, then time warm starts and a start with empty caches.
    SITE=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    t0=$(date +%s)
    python3 -m compileall -q -j 0 "$SITE" /tmp/pydeps "$ROOT/pagedserve" > /dev/null 2>&1
    echo "bytecode compiled in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    start warm_pyc1
    start warm_pyc2
    rm -rf "$TRITON_CACHE_DIR" "$PAGEDSERVE_PLAN_CACHE"
    if [ "${DROP_CACHES:-0}" = 1 ]; then  # a fresh machine's cold file cache, where permitted
        sync
        if echo 3 2> /dev/null > /proc/sys/vm/drop_caches; then msg="page cache dropped"
        else msg="the page cache could not be dropped (not permitted)"; fi
        echo "before cold_pyc: $msg" | tee -a "$OUT/summary.txt"
    fi
    start cold_pyc
fi
[ "${PYSPY:-1}" = 1 ] || { cat "$OUT/summary.txt"; exit 0; }
# the same warm start under py-spy: idle included, so the profile's shares are shares of wall time
t0=$(date +%s.%N)
/tmp/pydeps/bin/py-spy record --subprocesses --idle --rate 50 --format raw -o "$OUT/pyspy_start.txt" \
    -- "${SERVE[@]}" > "$OUT/serve_pyspy.log" 2>&1 &
SPY=$!
sleep 1
SERVER=$(pgrep -P $SPY | head -1)
echo "under py-spy: ready in $(wait_ready "$SERVER" "$t0") s" | tee -a "$OUT/summary.txt"
kill -TERM "$SERVER"; wait $SPY
python3 benchmarks/pyspy_summary.py "$OUT/pyspy_start.txt" --top 40 > "$OUT/pyspy_start_summary.txt" 2>&1
python3 -X importtime -c "import pagedserve.engine.core_process, pagedserve.models, pagedserve.engine.worker" \
    2> "$OUT/importtime.txt"
sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -15
for f in "$OUT"/serve_cold.log "$OUT"/serve_warm1.log "$OUT"/serve_warm_replan.log; do
    echo "== $f"; grep -E "engine-core|ready|serving|compiled|captured|planned|warm-up|KV cache|loaded" "$f" | cut -c1-200
done
head -60 "$OUT/pyspy_start_summary.txt"
cat "$OUT/summary.txt"
