#!/usr/bin/env bash
# Long-context prefill on the GPU machine (issue 30), in one device call:
#   SECTIONS="tests probe e2e" bash benchmarks/long_prefill_check.sh
# tests: tests/gpu/test_long_prefill_gpu.py (the long-context path against the extend kernel);
# probe: benchmarks/long_prefill_probe.py (one chunk's attention, each kernel, TFLOP/s);
# e2e:   `pagedserve bench throughput`, Qwen3-4B preset (dummy weights, bf16): one
#        250,000-token prompt and four 60,000-token prompts, one output token each
#        (elapsed_s is the prefill), under each $PAGEDSERVE_LONG_PREFILL in LONG (default
#        "off flash": the extend kernel, then FlashAttention). EXTRA passes more engine flags.
# Results go to $OUT (or ./long_prefill_results), one tar file (the device returns 8 files).
set -uo pipefail
OUT="${OUT:-long_prefill_results}"
SECTIONS="${SECTIONS:-tests probe e2e}"
EXTRA="${EXTRA:-}"
SPECS="${SPECS:-1x250000 4x60000}"  # prompts x tokens
LONG="${LONG:-off flash}"  # "best": the probe's faster kernel
mkdir -p "$OUT/r"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER="$PWD/.devtok"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/r/gpu.txt"
for s in $SECTIONS; do
    case $s in
    tests) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_long_prefill_gpu.py 2>&1 | tail -15 | tee "$OUT/r/tests.log" ;;
    probe) python3 benchmarks/long_prefill_probe.py --out "$OUT/r/probe.json" --best-to "$OUT/r/best" 2>&1 | tee "$OUT/r/probe.log"
        echo "faster long path: $(cat "$OUT/r/best")" ;;
    e2e)
        for long in $LONG; do
            [ "$long" = best ] && long=$(cat "$OUT/r/best" 2>/dev/null || echo flash)
            for spec in $SPECS; do
            set -- ${spec/x/ }
            name="e2e_${long}_$1x$2"
            PAGEDSERVE_LONG_PREFILL=$long python3 -m pagedserve.cli bench throughput qwen3-4b-instruct-2507 \
                --load-format dummy --tokenizer .devtok --dtype bfloat16 --num-prompts "$1" --input-len "$2" --output-len 1 \
                --max-model-len $(($2 + 16)) --dataset-name random --disable-tqdm $EXTRA \
                --output-json "$OUT/r/$name.json" > "$OUT/r/$name.log" 2>&1
            python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], 'prefill s', d['elapsed_s'], 'startup s', d['startup_s'])" "$OUT/r/$name.json" || tail -5 "$OUT/r/$name.log"
            tar -C "$OUT" -czf "$OUT/long_prefill.tgz" r
        done; done ;;
    *) echo "unknown section $s" ;;
    esac
    tar -C "$OUT" -czf "$OUT/long_prefill.tgz" r  # (after each section: a cut-off call keeps what ran)
done
