#!/usr/bin/env bash
# Structured output's cost at concurrency 64, two engines alternated in one lease (issue 24):
#   VARIANTS="base=.cache/ab_old head=." bash benchmarks/structured_ab.sh
# Each variant is a folder holding a `pagedserve` package (a checkout, or `git archive REV
# pagedserve | tar -x -C DIR` carried beside this one). For each of ROUNDS (2) rounds and each
# variant (order reversed every other round, so drift shows), one `pagedserve serve` of the
# Qwen3-4B preset (dummy weights, bf16, the stand-in tokenizer) is measured by this checkout's
# `pagedserve bench serve`: free completions, then every request under
# benchmarks/schemas/catalogue.json, PROMPTS (512) prompts of 1,024 token ids in, 128 out.
# Prints one table; JSON to $OUT (or ./structured_ab_results). Needs .whl/ and .devtok/ as
# structured_check.sh does. SKIP_TESTS=1 skips tests/gpu/test_structured_gpu.py.
set -uo pipefail
ROOT="$PWD"
OUT="${OUT:-structured_ab_results}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
export PYTHONPATH="/tmp/pydeps" PS_TOKENIZER="$ROOT/.devtok"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    PYTHONPATH="$ROOT:/tmp/pydeps" python3 -m pytest -p no:cacheprovider -q tests/gpu/test_structured_gpu.py \
        > "$OUT/pytest.log" 2>&1
    tail -1 "$OUT/pytest.log"
fi
PORT=8000
BENCH="python3 -m pagedserve.cli bench serve --base-url http://127.0.0.1:$PORT --no-progress --temperature 0 --input-len 1024 --output-len 128 --max-concurrency 64 --warmup 8"
read -r -a VARS <<< "${VARIANTS:-base=.cache/ab_old head=.}"
ROUNDS="${ROUNDS:-2}"; PROMPTS="${PROMPTS:-512}"
for round in $(seq "$ROUNDS"); do
    order=("${VARS[@]}")
    if [ $((round % 2)) = 0 ]; then order=(); for ((i=${#VARS[@]}-1; i>=0; i--)); do order+=("${VARS[$i]}"); done; fi
    for v in "${order[@]}"; do
        name="${v%%=*}"; dir="${v#*=}"
        (cd "$dir" && PYTHONPATH="$PWD:/tmp/pydeps" PAGEDSERVE_STEP_TIMES=200 exec python3 -m pagedserve.cli serve \
            qwen3-4b-instruct-2507 --load-format dummy --tokenizer "$ROOT/.devtok" --port $PORT \
            --log-level INFO --disable-log-requests) > "$OUT/server_${name}_r$round.log" 2>&1 &
        server=$!
        for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
        seed=$((100 * round))
        PYTHONPATH="$ROOT:/tmp/pydeps" $BENCH --num-prompts "$PROMPTS" --seed $((seed + 1)) \
            --save-result "$OUT/ab_${name}_r${round}_free.json" > /dev/null 2>&1
        PYTHONPATH="$ROOT:/tmp/pydeps" $BENCH --num-prompts "$PROMPTS" --seed $((seed + 2)) \
            --json-schema benchmarks/schemas/catalogue.json \
            --save-result "$OUT/ab_${name}_r${round}_schema.json" > /dev/null 2>&1
        grep "host ms per step" "$OUT/server_${name}_r$round.log" | tail -3 | sed "s/^.*INFO engine-core: /$name c64: /" | cut -c1-330
        if [ "${C1:-1}" = 1 ]; then  # one user: a constrained request's TPOT against a free one's
            for kind in free schema; do
                flags=(); [ $kind = schema ] && flags=(--json-schema benchmarks/schemas/catalogue.json)
                PYTHONPATH="$ROOT:/tmp/pydeps" ${BENCH/--max-concurrency 64 --warmup 8/--max-concurrency 1 --warmup 2} \
                    --num-prompts 24 --seed $((seed + 3)) "${flags[@]}" \
                    --save-result "$OUT/c1_${name}_r${round}_$kind.json" > /dev/null 2>&1
            done
        fi
        kill -TERM $server; wait $server
        grep "host ms per step" "$OUT/server_${name}_r$round.log" | tail -1 | sed "s/^.*INFO engine-core: /$name c1: /" | cut -c1-330
    done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_r*_*.json"))):
    level, name, rnd, kind = os.path.basename(f)[:-5].split("_")
    rows[(level, name, rnd, kind)] = json.load(open(f))["runs"][0]
print(f"{'level':<5} {'variant':<8} {'round':<5} {'free tok/s':>10} {'schema tok/s':>12} {'diff':>7} "
      f"{'TPOT free/schema':>17} {'failed':>6}")
for (level, name, rnd, kind), r in sorted(rows.items()):
    if kind != "free" or (level, name, rnd, "schema") not in rows:
        continue
    s = rows[(level, name, rnd, "schema")]
    d = s["output_throughput"] / r["output_throughput"] - 1
    print(f"{'c64' if level == 'ab' else level:<5} {name:<8} {rnd:<5} {r['output_throughput']:>10.0f} "
          f"{s['output_throughput']:>12.0f} {d:>+7.1%} {r['tpot_ms']['median']:>8.2f}/{s['tpot_ms']['median']:<8.2f} "
          f"{r['failed'] + s['failed']:>6}")
PY
