"""Quality of the quantized formats on real weights (issue 26): teacher-forced next-token
agreement with the float32 model, and perplexity, over a fixed English text
(`benchmarks/texts/quality_en.txt`, 1,900 tokens in 18 passages), each with its standard
error and, for every variant, its difference from bf16 paired on the same positions.

    python benchmarks/quant_quality.py [--device cuda] [--out results.json]

The model is the embedded SmolLM2-135M-Instruct (real weights). Variants: float32 (the
reference), bf16, FP8 weights and activations (`--quantization fp8`: on a Hopper GPU the real
FP8 products, elsewhere the dequantizing reference path), FP8 weights with an FP8 KV cache
(attention reads every key and value back from the cache), and 4-bit AWQ and GPTQ checkpoints
made by round-to-nearest per group of 64 (the reference quantizer of tests/test_int4.py, not
AWQ's or GPTQ's own search; SmolLM2's 576 inputs are not a multiple of 128), loaded as any
AWQ/GPTQ checkpoint is. Each variant prefills every passage of the text on its own through the
torch attention backend.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# a fixed English text of 1,900 tokens in 18 passages (blank lines between them), each
# prefilled on its own: with 281 tokens the agreement's standard error was ~1.8 points, too
# coarse for the 1-2 point question
TEXT_FILE = ROOT / "benchmarks" / "texts" / "quality_en.txt"


def passages() -> list[str]:
    """The fixed text's passages, in order."""
    return [p.strip() for p in TEXT_FILE.read_text().split("\n\n") if p.strip()]


def encoded_passages(source) -> list[list[int]]:
    """The fixed text's passages as token ids of `source`'s tokenizer (no special tokens)."""
    from pagedserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(source.folder)
    return [tokenizer.encode(text, add_special_tokens=False) for text in passages()]


def mean_and_error(x: torch.Tensor) -> tuple[float, float]:
    """The mean of per-position values x [tokens] and its standard error."""
    return x.mean().item(), x.std().item() / math.sqrt(x.numel())


def logits_of(model, ids: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one prefill; attention reads K/V back from a paged
    cache stored as `kv_cache_dtype`."""
    from pagedserve.attention.backend import AttentionContext, CommonAttentionMetadata
    from pagedserve.attention.torch_ref import TorchReferenceBackend
    from pagedserve.engine.kv_cache_spec import KVCacheSpec

    cfg, n, bs = model.config, len(ids), 16
    dev = model.embed_tokens.weight.device
    spec = KVCacheSpec.for_model(cfg, bs, model.embed_tokens.weight.dtype, kv_cache_dtype)
    backend = TorchReferenceBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale)
    nb = -(-n // bs)
    backend.bind_kv_caches(spec.allocate(nb, dev), spec.allocate_scales(dev))
    common = CommonAttentionMetadata.for_prefill([n], dev)
    common.slot_mapping = torch.arange(n, device=dev)
    common.block_tables = torch.arange(nb, dtype=torch.int32, device=dev)[None]
    meta = backend.metadata(common)
    with torch.no_grad():
        hidden = model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), AttentionContext(backend, meta))
        return model.compute_logits(hidden).float()


def int4_checkpoint(folder: Path, fmt: str) -> Path:
    """SmolLM2 quantized to 4 bits (group 64) by tests/test_int4.py's reference quantizer:
    AWQ with zero points, GPTQ symmetric (its usual setting)."""
    from safetensors.torch import load_file

    from pagedserve.models.source import resolve_model

    sys.path.insert(0, str(ROOT / "tests"))
    from test_int4 import write_checkpoint  # the tests' reference quantizer

    src = resolve_model(None)
    state = load_file(str(src.folder / "model.safetensors"))
    write_checkpoint(folder / fmt, src.hf_config, state, fmt, 64, sym=fmt == "gptq")
    return folder / fmt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    from pagedserve.bench.run_info import device_name, git_commit
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model
    from pagedserve.quantization import resolve_quantization

    source = resolve_model(None)
    docs = encoded_passages(source)
    tmp = Path(tempfile.mkdtemp())
    half = "bfloat16"
    variants = {  # name -> (model source, dtype, quantization, kv cache dtype)
        "float32": (source, "float32", None, "auto"),
        "bf16": (source, half, None, "auto"),
        "fp8": (source, half, "fp8", "auto"),
        "fp8 + fp8 KV": (source, half, "fp8", "fp8"),
        "bf16 + fp8 KV": (source, half, None, "fp8"),
    }
    for fmt in ("awq", "gptq"):
        folder = resolve_model(str(int4_checkpoint(tmp, fmt)))
        variants[f"{fmt} int4 g64{' sym' if fmt == 'gptq' else ''}"] = (folder, half, resolve_quantization(None, folder.hf_config), "auto")
    ref = bf16 = None
    rows = []
    for name, (src, dtype, quant, kv) in variants.items():
        model = build_model(src, dtype=dtype, device=args.device, quantization=quant)
        top1, nll = [], 0.0
        for ids in docs:
            logits = logits_of(model, ids, kv)  # [n, vocab]
            target = torch.tensor(ids[1:], device=logits.device)
            nll += torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum").item()
            top1.append(logits.argmax(-1).cpu())
        top1 = torch.cat(top1)  # [tokens]: every position's greedy next token
        ref = top1 if ref is None else ref
        bf16 = top1 if name == "bf16" else bf16
        hit = (top1 == ref).float()  # [tokens]
        agree, se = mean_and_error(hit)
        row = {"variant": name, "agreement_with_float32": round(agree, 4), "standard_error": round(se, 4),
               "perplexity": round(math.exp(nll / (hit.numel() - len(docs))), 3)}
        line = f"{name:<18} agreement {agree:7.2%} +- {se:.2%}  perplexity {row['perplexity']:8.3f}"
        if bf16 is not None and name != "bf16":
            # paired against bf16 on the same positions: its standard error is the one that
            # says whether the two differ
            diff, diff_se = mean_and_error(hit - (bf16 == ref).float())
            row["minus_bf16"] = round(diff, 4)
            row["minus_bf16_standard_error"] = round(diff_se, 4)
            line += f"  vs bf16 {diff:+7.2%} +- {diff_se:.2%}"
        rows.append(row)
        print(line, flush=True)
        del model
    result = {"benchmark": "quant_quality", "model": "SmolLM2-135M-Instruct (embedded, real weights)",
              "text": str(TEXT_FILE.relative_to(ROOT)), "passages": len(docs),
              "tokens": sum(len(d) for d in docs), "device": device_name(args.device), "commit": git_commit(),
              "command": "python benchmarks/quant_quality.py --device " + args.device, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
