#!/usr/bin/env bash
# Tensor parallelism and the multi-process executor on the GPU machine (issues 28, 29):
#   SECTIONS="tests latency tp2" bash benchmarks/tp_check.sh
#   tests:   tests/gpu/test_tensor_parallel_gpu.py (one rank in a worker process: CUDA graphs,
#            the in-process tokens; two ranks where there are two GPUs).
#   latency: `bench latency`, Qwen3-4B preset (dummy weights), 512-token prompts, batch
#            1/16/64/256, in process (uni) and through the multi-process executor at one rank
#            (mp): issue 28's target is mp within 2% of uni.
#   tp2:     (two GPUs) the same at --tensor-parallel-size 2 (NCCL_NVLS_ENABLE=0).
# The GPU machine has no network: wheels from .whl/, the stand-in tokenizer from .devtok/.
# Results go to $OUT (or ./tp_results); a short table comes last.
set -uo pipefail
OUT="${OUT:-tp_results}"
SECTIONS="${SECTIONS:-tests latency}"
mkdir -p "$OUT"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER=.devtok NCCL_NVLS_ENABLE=0
PS="python3 -m pagedserve.cli"
MODEL=qwen3-4b-instruct-2507
LAT="$PS bench latency $MODEL --load-format dummy --tokenizer .devtok --batch-sizes ${BATCHES:-1,16,64,256} --input-len 512 --steps 64"
if has tests; then
    python3 -m pytest -p no:cacheprovider -s tests/gpu/test_tensor_parallel_gpu.py > "$OUT/pytest.log" 2>&1
    tail -3 "$OUT/pytest.log"
fi
if has latency; then  # (alternated, twice each: the two are compared within one lease)
    for round in 1 2; do
        for backend in uni mp; do
            $LAT --distributed-executor-backend $backend --output-json "$OUT/latency_${backend}_$round.json" \
                > "$OUT/latency_${backend}_$round.log" 2>&1
        done
    done
fi
if has tp2; then
    $LAT --tensor-parallel-size 2 --output-json "$OUT/latency_tp2.json" > "$OUT/latency_tp2.log" 2>&1
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print(f"{'run':<10} {'batch':>5} {'ms/step':>8} {'efficiency':>10}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "latency_*.json"))):
    for r in json.load(open(path))["rows"]:
        print(f"{os.path.basename(path)[8:-5]:<10} {r['batch']:>5} {r['ms_per_step']:>8} {r['roofline_efficiency']!s:>10}")
PY
