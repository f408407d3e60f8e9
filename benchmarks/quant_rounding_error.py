"""Where 8-bit formats lose precision on SmolLM2 (issue 60): the relative RMS rounding error
||round(x) - x|| / ||x|| of the decoder projections' weights (bf16; e4m3 per output row and per
tensor; int8 per output row) and of their inputs (e4m3 and int8 per token, over the first
passage of each kind of text of `quality_texts.py`, float32 model), by projection kind; and of
the keys and values an FP8 KV cache stores (e4m3 with the cache's scale of 1.0 per layer,
with a per-layer scale of amax / 448, and with a dynamic scale per token and KV head).

    python benchmarks/quant_rounding_error.py [--out results.json]

Cheap (one pass over the weights, four prefills). e4m3 is a float format: its relative error
does not depend on the scale, so a finer scale (per row instead of per tensor) barely changes
it; int8 is uniform between -amax and amax, so a row's scale matters, and outliers cost it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quality_texts  # noqa: E402
from quant_quality import logits_of  # noqa: E402

FP8 = torch.float8_e4m3fn
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def e4m3(x: torch.Tensor, per_row: bool = True) -> torch.Tensor:
    """x [R, C] rounded to e4m3 with a scale per row (or one for the tensor), scaled back."""
    amax = x.abs().amax(1, keepdim=True) if per_row else x.abs().amax()
    s = amax.clamp_min(1e-12) / 448
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def int8(x: torch.Tensor) -> torch.Tensor:
    """x [R, C] rounded to int8 (symmetric, a scale per row), scaled back."""
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return (x / s).round().clamp(-127, 127) * s


class Errors:
    """Sums of squared errors and squared values, by (what, format)."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, str], list[float]] = {}

    def add(self, what: str, fmt: str, x: torch.Tensor, rounded: torch.Tensor) -> None:
        s = self.sums.setdefault((what, fmt), [0.0, 0.0])
        s[0] += ((rounded - x) ** 2).sum().item()
        s[1] += (x * x).sum().item()

    def rows(self) -> list[dict]:
        return [{"tensors": what, "format": fmt, "relative_rms_error": round((e / n) ** 0.5, 5)}
                for (what, fmt), (e, n) in self.sums.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from pagedserve.bench.run_info import git_commit
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model
    from pagedserve.tokenizer import Tokenizer

    src = resolve_model(None)
    model = build_model(src, dtype="float32", device="cpu")
    errors = Errors()
    for name, mod in model.named_modules():
        if name.endswith(KINDS):
            w = mod.weight.data.float()  # [out, in]
            for fmt, f in (("bf16", lambda x: x.bfloat16().float()), ("e4m3 per row", e4m3),
                           ("e4m3 per tensor", lambda x: e4m3(x, False)), ("int8 per row", int8)):
                errors.add("weights (all projections)", fmt, w, f(w))

    def hook(name: str):
        def record(_mod, args):
            x = args[0].float()  # [tokens, in]
            for fmt, f in (("e4m3 per token", e4m3), ("int8 per token", int8)):
                errors.add(f"inputs of {name.split('.')[-1]}", fmt, x, f(x))
        return record

    for name, mod in model.named_modules():
        if name.endswith(KINDS):
            mod.register_forward_pre_hook(hook(name))
    from pagedserve.attention.torch_ref import TorchReferenceBackend

    kv: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}  # per forward and layer
    attend = TorchReferenceBackend.forward

    def recording(self, layer_idx, q, k, v, *rest, **kw):
        kv["keys"].append(k.float().reshape(k.shape[0], -1, model.config.head_dim))  # [T, kv heads, D]
        kv["values"].append(v.float().reshape(v.shape[0], -1, model.config.head_dim))
        return attend(self, layer_idx, q, k, v, *rest, **kw)

    TorchReferenceBackend.forward = recording
    tokenizer = Tokenizer.from_pretrained(src.folder)
    try:
        for kind in quality_texts.KINDS:
            logits_of(model, quality_texts.encoded(tokenizer, kind)[0])
    finally:
        TorchReferenceBackend.forward = attend
    layers = model.config.num_layers
    for what, xs in kv.items():
        for x in xs:
            errors.add(f"KV cache {what}", "e4m3, scale 1.0", x, x.clamp(-448, 448).to(FP8).float())
            errors.add(f"KV cache {what}", "e4m3 per token and head", x,
                       e4m3(x.reshape(-1, x.shape[-1])).reshape(x.shape))
        for i in range(layers):  # a calibrated scale per layer: its amax over all four texts
            mine = xs[i::layers]
            s = max(x.abs().amax().item() for x in mine) / 448
            for x in mine:
                errors.add(f"KV cache {what}", "e4m3, per-layer amax scale", x,
                           (x / s).clamp(-448, 448).to(FP8).float() * s)
    rows = errors.rows()
    for r in rows:
        print(f"{r['tensors']:<28} {r['format']:<16} {r['relative_rms_error']:.4f}")
    result = {"benchmark": "quant_rounding_error", "model": "SmolLM2-135M-Instruct (embedded, real weights)",
              "device": "CPU", "commit": git_commit(), "command": "python benchmarks/quant_rounding_error.py",
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
