"""Stamp a `bench serve` result from the GPU machine before it is committed: the command line,
the commit measured, the GPU, and each run's roofline efficiency.

    python3 benchmarks/annotate_result.py RESULT.json --commit abc1234 --command "..." \
        --gpu "NVIDIA H200 ..." [--model qwen3-4b-instruct-2507] [--note "..."] [-o OUT.json]

The roofline (pagedserve/bench/roofline.py) gives each run an ideal time from its mean prompt
and output lengths: every prompt prefilled at peak FLOP/s, decode in waves of max_concurrency
sequences at the measured copy bandwidth; efficiency = ideal / measured duration.
"""

from __future__ import annotations

import argparse
import json

from pagedserve.bench.roofline import Roofline
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.presets import load_preset

METHOD = ("pagedserve/bench/roofline.py workload_seconds over each run's mean prompt and output "
          "lengths: every prompt prefilled at 790 TFLOP/s, decode in waves of max_concurrency "
          "sequences at 4.25 TB/s; efficiency = ideal / measured duration")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--model", default="qwen3-4b-instruct-2507")
    ap.add_argument("--note", default=None)
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    roof = Roofline.for_model(model_config_from_hf(load_preset(args.model)))
    for run in result["runs"]:
        n = run["completed"]
        if not n:
            continue
        ins = [round(run["input_tokens"] / n)] * n
        outs = [round(run["output_tokens"] / n)] * n
        ideal = roof.workload_seconds(ins, outs, run["max_concurrency"] or n)
        run["roofline"] = {"ideal_s": round(ideal, 3),
                           "ideal_output_throughput": round(run["output_tokens"] / ideal, 1),
                           "efficiency": round(ideal / run["duration_s"], 3)}
    result.update(command=args.command, commit=args.commit, gpu=args.gpu, roofline_method=METHOD)
    if args.note:
        result["note"] = args.note
    with open(args.output or args.result, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
