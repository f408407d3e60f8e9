"""Where FP8 loses its agreement on SmolLM2 (issue 26): the float32 model with an e4m3 round
trip applied to chosen projections only, to their weights (per output channel, as
`--quantization fp8` scales them), to their inputs (per token, as its dynamic activation scales
do), or to both; each case's teacher-forced next-token agreement with plain float32 over
quant_quality.py's fixed text.

    python benchmarks/fp8_sensitivity.py [--out results.json]

A simulation in float32 on the CPU (a few minutes): it separates the cost of each projection
kind and of the first and last layers, which the real FP8 path cannot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quant_quality import encoded_passages, logits_of, mean_and_error  # noqa: E402

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] scaled per row to e4m3's range (448), rounded to e4m3 and scaled back."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0  # [rows, 1]
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    from pagedserve.bench.run_info import git_commit
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    source = resolve_model(None)
    docs = encoded_passages(source)
    model = build_model(source, dtype="float32", device="cpu")
    linears = {n: m for n, m in model.named_modules() if n.endswith(PROJECTIONS)}
    original = {n: m.weight.data.clone() for n, m in linears.items()}

    def greedy() -> torch.Tensor:  # [tokens]: every position's greedy next token
        return torch.cat([logits_of(model, ids).argmax(-1) for ids in docs])

    reference = greedy()

    def agreement(chosen, weights: bool, inputs: bool) -> tuple[float, float]:
        hooks = []
        for name, layer in linears.items():
            if chosen(name) and weights:
                layer.weight.data.copy_(e4m3_round_trip(original[name]))
            if chosen(name) and inputs:
                hooks.append(layer.register_forward_pre_hook(lambda _m, a: (e4m3_round_trip(a[0]),) + a[1:]))
        hit = (greedy() == reference).float()  # [tokens]
        for hook in hooks:
            hook.remove()
        for name, layer in linears.items():
            layer.weight.data.copy_(original[name])
        return mean_and_error(hit)

    last = len(model.layers) - 1
    cases = {"every projection": lambda n: True}
    cases.update({kind: (lambda k: lambda n: n.endswith(k))(kind) for kind in PROJECTIONS})
    cases["layer 0"] = lambda n: n.startswith("layers.0.")
    cases[f"layer {last} (last)"] = lambda n: n.startswith(f"layers.{last}.")
    cases[f"layers 1-{last - 1}"] = lambda n: not n.startswith(("layers.0.", f"layers.{last}."))
    rows = []
    for case, chosen in cases.items():
        for rounded, weights, inputs in (("weights", True, False), ("inputs", False, True), ("both", True, True)):
            mean, se = agreement(chosen, weights, inputs)
            rows.append({"projections": case, "rounded": rounded, "agreement_with_float32": round(mean, 4),
                         "standard_error": round(se, 4)})
            print(f"{case:<20} {rounded:<8} {mean:7.2%} +- {se:.2%}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "fp8_sensitivity", "model": "SmolLM2-135M-Instruct (embedded, real weights)",
            "device": "cpu (float32 simulation)", "tokens": sum(len(d) for d in docs), "commit": git_commit(),
            "command": "python benchmarks/fp8_sensitivity.py", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
