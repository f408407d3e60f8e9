#!/usr/bin/env bash
# Model families on the GPU machine (issue 31):
#   SECTIONS="tests moe latency throughput" bash benchmarks/families_check.sh
#   tests:      tests/gpu/test_model_families_gpu.py (each new family's greedy tokens against
#               Transformers', fp32, graphs), tests/gpu/test_fused_moe_gpu.py, and
#               tests/gpu/test_sliding_window_gpu.py (the kernels' windows).
#   kernels:    the attention kernels' own GPU tests (their sliding windows changed them) and
#               benchmarks/sliding_window_decode.py.
#   moe:        benchmarks/moe_kernel_bench.py (the fused-MoE kernel alone, bf16).
#   latency:    `bench latency`, qwen3-30b-a3b (batch 1/16/64/256) and llama-3.2-3b-instruct
#               (batch 1/64), and qwen3-4b-instruct-2507 (batch 1/64/256: the windowless
#               kernels' speed), dummy weights, 512-token prompts.
#   throughput: `bench throughput` qwen3-30b-a3b, 256 prompts U[100,1024] in and out.
# The GPU machine has no network: wheels from .whl/, the stand-in tokenizer from .devtok/.
# Results go to $OUT (or ./families_results); a short table comes last.
set -uo pipefail
OUT="${OUT:-families_results}"
SECTIONS="${SECTIONS:-tests kernels moe latency throughput}"
mkdir -p "$OUT"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl 2>/dev/null
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER=.devtok
PS="python3 -m pagedserve.cli"
if has tests; then
    python3 -m pytest -p no:cacheprovider -q tests/gpu/test_model_families_gpu.py tests/gpu/test_fused_moe_gpu.py \
        $(ls tests/gpu/test_sliding_window_gpu.py 2>/dev/null) > "$OUT/pytest.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -8
fi
if has kernels; then
    python3 -m pytest -p no:cacheprovider -q tests/gpu/test_kernels_gpu.py tests/gpu/test_fp8_kv_gpu.py \
        > "$OUT/pytest_kernels.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$OUT/pytest_kernels.log" | tail -8
    python3 benchmarks/sliding_window_decode.py 2>&1 | tail -3
fi
if has moe; then
    python3 benchmarks/moe_kernel_bench.py --output-json "$OUT/moe_kernel.json" 2>&1 | tail -12
fi
if has latency; then
    $PS bench latency qwen3-30b-a3b --load-format dummy --tokenizer .devtok --batch-sizes 1,16,64,256 \
        --input-len 512 --steps 64 --output-json "$OUT/latency_qwen3-30b-a3b.json" > "$OUT/latency_moe.log" 2>&1
    $PS bench latency llama-3.2-3b-instruct --load-format dummy --tokenizer .devtok --batch-sizes 1,64 \
        --input-len 512 --steps 64 --output-json "$OUT/latency_llama-3.2-3b.json" > "$OUT/latency_llama.log" 2>&1
    $PS bench latency qwen3-4b-instruct-2507 --load-format dummy --tokenizer .devtok --batch-sizes 1,64,256 \
        --input-len 512 --steps 64 --output-json "$OUT/latency_qwen3-4b.json" > "$OUT/latency_qwen3-4b.log" 2>&1
fi
if has throughput; then
    $PS bench throughput qwen3-30b-a3b --load-format dummy --tokenizer .devtok --dtype bfloat16 --max-model-len 4096 \
        --num-prompts 256 --input-range 100 1024 --output-range 100 1024 --temperature 0.6 --seed 0 --warmup \
        --output-json "$OUT/throughput_qwen3-30b-a3b_u100_1024.json" > "$OUT/throughput_moe.log" 2>&1
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "latency_*.json"))):
    r = json.load(open(path))
    print(os.path.basename(path), "start-up", r.get("startup_s"), "s")
    for row in r["rows"]:
        print(f"  batch {row['batch']:>4}: {row['ms_per_step']:>7} ms/step, roofline {row['roofline_efficiency']}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "throughput_*.json"))):
    r = json.load(open(path))
    keep = {k: r.get(k) for k in ("output_tokens_per_s", "total_tokens_per_s", "roofline_efficiency", "startup_s")}
    print(os.path.basename(path), keep)
PY
