#!/usr/bin/env bash
# Issue 56 (features compose: EngineArgs, the executor's three verbs, the staged runner) on the
# GPU machine: the same measurements of a base tree and of this tree, alternated in one lease.
#   bash benchmarks/compose_ab.sh base new      # then, in a second call: new base
#   bash benchmarks/compose_ab.sh tests         # the GPU tests of this tree
# base: a folder .abbase holding the base commit's pagedserve/ (git archive COMMIT pagedserve |
# tar -x -C .abbase). Each tree, Qwen3-4B preset with dummy weights, bf16: decode steps at
# batch 1/64/256 (bench latency), offline throughput 1,024/128 and U[100, 1,024] (bench
# throughput), serving at concurrency 64 and 256 (bench serve against a launched server, whose
# step timer logs the host milliseconds per step phase every 200 steps). Wheels from .whl/ and
# the stand-in tokenizer .devtok/ (benchmarks/device_wheels.sh). Results: $OUT/ab.tgz
# (<tree>_<n>_*.json and the logs); a table last.
set -uo pipefail
DEST="${OUT:-ab_results}"  # (at most 8 files come back from the GPU machine: one archive)
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
OUT=/tmp/ab_work
mkdir -p "$OUT"
ROOT="$PWD"
if [ ! -d /tmp/pydeps ] && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl
fi
export PYTHONUNBUFFERED=1 PS_TOKENIZER="$ROOT/.devtok"  # (the GPU machine has no embedded model)
MODEL=qwen3-4b-instruct-2507
COMMON="--load-format dummy --tokenizer $ROOT/.devtok --dtype bfloat16 --max-model-len 4096 --log-level WARNING"
# SCALE=small: fewer prompts and steps (a shorter lease)
# (tiny: no U[100, 1,024] run; offline: no serving run either)
case "${SCALE:-full}" in
    small) STEPS=32 P1=300 P2=128 PS=128,512 ;;
    tiny) STEPS=32 P1=300 P2=0 PS=128,512 ;;
    offline) STEPS=32 P1=300 P2=0 PS= ;;  # (no serving run either)
    *) STEPS=48 P1=500 P2=256 PS=256,768 ;;
esac
n=0
for tree in "$@"; do
    n=$((n + 1))
    if [ "$tree" = tests ]; then
        PYTHONPATH="$ROOT:/tmp/pydeps" python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -25
        continue
    fi
    dir="$ROOT"; [ "$tree" = base ] && dir="$ROOT/.abbase"
    tag="${tree}_$n"
    export PYTHONPATH="$dir:/tmp/pydeps"
    cd "$dir" || exit 1
    echo "=== $tag ($dir)"
    timeout 150 python3 -m pagedserve.cli bench latency $MODEL $COMMON --batch-sizes 1,64,256 --input-len 512 \
        --steps $STEPS --output-json "$OUT/${tag}_latency.json" > "$OUT/${tag}_latency.log" 2>&1
    timeout 150 python3 -m pagedserve.cli bench throughput $MODEL $COMMON --num-prompts $P1 --input-len 1024 \
        --output-len 128 --dataset fixed --warmup --disable-tqdm --output-json "$OUT/${tag}_1024_128.json" \
        > "$OUT/${tag}_1024_128.log" 2>&1
    [ "$P2" -gt 0 ] && timeout 150 python3 -m pagedserve.cli bench throughput $MODEL $COMMON --num-prompts $P2 --input-range 100 1024 \
        --output-range 100 1024 --temperature 0.6 --warmup --disable-tqdm \
        --output-json "$OUT/${tag}_u100_1024.json" > "$OUT/${tag}_u100_1024.log" 2>&1
    [ -n "$PS" ] && PAGEDSERVE_STEP_TIMES=200 timeout 200 python3 -m pagedserve.cli bench serve \
        --launch "python3 -m pagedserve.cli serve $MODEL $COMMON --log-level INFO --port 8000" \
        --launch-log "$OUT/${tag}_server.log" --base-url http://127.0.0.1:8000 --no-progress \
        --temperature 0 --ignore-eos --input-len 1024 --output-len 128 --concurrency-sweep 64,256 \
        --num-prompts-per-level $PS --warmup 8 --save-result "$OUT/${tag}_serve.json" \
        > "$OUT/${tag}_serve.log" 2>&1
    pkill -f "pagedserve.cli serve" 2>/dev/null; sleep 1  # (a server left by a timed-out run)
    cd "$ROOT" || exit 1
    python3 - "$OUT" "$tag" <<'PYEOF'
import json, re, sys
out, tag = sys.argv[1:]
def load(name):
    try:
        return json.load(open(f"{out}/{tag}_{name}.json"))
    except Exception as e:
        return {"error": repr(e)}
lat = load("latency")
row = {r["batch"]: r["ms_per_step"] for r in lat.get("rows", [])}
serve = load("serve")
levels = {}
for r in serve.get("runs", []):
    levels[r["max_concurrency"]] = r
try:
    steps = re.findall(r"host ms per step: .*", open(f"{out}/{tag}_server.log", errors="replace").read())
except OSError:
    steps = []
print(tag, "decode ms b1/b64/b256:", [row.get(b) for b in (1, 64, 256)],
      "| 1024/128 out tok/s:", load("1024_128").get("output_tokens_per_s"),
      "| U[100,1024] out tok/s:", load("u100_1024").get("output_tokens_per_s"),
      "| serve out tok/s, p50 TPOT:", {c: (round(r["output_throughput"]), round(r["tpot_ms"]["median"], 2)) for c, r in levels.items()},
      "| step timer (last):", steps[-1][:200] if steps else None)
PYEOF
    tar czf "$DEST/ab.tgz" -C "$OUT" .  # (after each tree: a run cut short keeps what it measured)
done
tar czf "$DEST/ab.tgz" -C "$OUT" .
