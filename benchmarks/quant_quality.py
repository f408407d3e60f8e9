"""Quality of the quantized formats on real weights (issues 26, 60): for each scheme, against
the float32 model on the same inputs, teacher-forced over four kinds of text (prose, code,
numbers, chat: `benchmarks/quality_texts.py`; by default the first 1,500 positions of each, 5,600
in all): top-1 agreement (with its
standard error), mean KL divergence KL(float32 || scheme) and perplexity; and the share of
changed greedy continuations (16 prompts, 32 tokens each). The noise floor is a scheme against
itself at another batch size (bf16: passages three to a forward instead of one, continuations
five to a forward instead of sixteen).

    python benchmarks/quant_quality.py [--device cuda] [--out results.json] [--int4] [--per-kind N]

The model is the embedded SmolLM2-135M-Instruct (real weights). Schemes: float32 (the
reference), bf16, FP8 weights and activations (`--quantization fp8`: on a Hopper GPU the real
FP8 products, elsewhere the dequantizing reference path), FP8 with an FP8 KV cache, bf16 with
an FP8 KV cache, INT8 W8A8 (`--quantization int8`: on a GPU the Triton int8 GEMM, on the CPU
`torch._int_mm`), and with `--int4` the 4-bit AWQ and GPTQ checkpoints made by round-to-nearest
per group of 64 (tests/test_int4.py's reference quantizer). Every forward runs through the
torch attention backend over a paged cache, so attention reads each key and value back from
the cache as stored. On a GPU the kernels sum in another order than the CPU: compare numbers
of one device.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quality_texts  # noqa: E402

CHUNK = 3  # passages compared at a time: the noise-floor schemes run them in one forward
NEW_TOKENS = 32  # greedy continuation length


def encoded_passages(source) -> list[list[int]]:
    """The prose passages as token ids of `source`'s tokenizer (fp8_sensitivity.py's text)."""
    from pagedserve.tokenizer import Tokenizer

    return quality_texts.encoded(Tokenizer.from_pretrained(source.folder), "prose")


def mean_and_error(x: torch.Tensor) -> tuple[float, float]:
    """The mean of per-position values x [tokens] and its standard error."""
    return x.mean().item(), x.std().item() / math.sqrt(x.numel())


class PagedRun:
    """`num_seqs` sequences of `model` over one paged cache stored as `kv_cache_dtype`, fed
    in steps (the torch reference attention backend)."""

    def __init__(self, model, num_seqs: int, max_len: int, kv_cache_dtype: str = "auto") -> None:
        from pagedserve.attention.torch_ref import TorchReferenceBackend
        from pagedserve.engine.kv_cache_spec import KVCacheSpec

        cfg, self.bs = model.config, 16
        self.model, self.dev = model, model.embed_tokens.weight.device
        spec = KVCacheSpec.for_model(cfg, self.bs, model.embed_tokens.weight.dtype, kv_cache_dtype)
        self.per_seq = -(-max_len // self.bs)
        self.backend = TorchReferenceBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale)
        self.backend.bind_kv_caches(spec.allocate(num_seqs * self.per_seq, self.dev), spec.allocate_scales(self.dev))
        self.lens = [0] * num_seqs

    def step(self, new: list[list[int]]) -> torch.Tensor:
        """Feed each sequence its new tokens `new[i]`; float32 logits [sum of lens, vocab]."""
        from pagedserve.attention.backend import AttentionContext, CommonAttentionMetadata

        qlens = [len(t) for t in new]
        seq_lens = [n + q for n, q in zip(self.lens, qlens)]
        starts, slots, positions = [0], [], []
        for i, (n, s) in enumerate(zip(self.lens, seq_lens)):
            starts.append(starts[-1] + s - n)
            positions += range(n, s)
            slots += [(i * self.per_seq + p // self.bs) * self.bs + p % self.bs for p in range(n, s)]
        dev, nseq = self.dev, len(new)
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.arange(nseq * self.per_seq, dtype=torch.int32, device=dev).view(nseq, -1),
            max_query_len=max(qlens), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
        self.lens = seq_lens
        ids = torch.tensor([t for seq in new for t in seq], device=dev)
        with torch.no_grad():
            hidden = self.model(ids, torch.tensor(positions, device=dev),
                                AttentionContext(self.backend, self.backend.metadata(common)))
            return self.model.compute_logits(hidden).float()  # [tokens, vocab]


def logits_of(model, ids: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one prefill of `ids`."""
    return PagedRun(model, 1, len(ids), kv_cache_dtype).step([ids])


def teacher_forced(model, docs: list[list[int]], kv: str, group: int) -> list[torch.Tensor]:
    """Each passage's logits [len, vocab], `group` passages to a forward."""
    out = []
    for i in range(0, len(docs), group):
        part = docs[i:i + group]
        logits = PagedRun(model, len(part), max(map(len, part)), kv).step(part)
        out += list(logits.split([len(d) for d in part]))
    return out


def greedy(model, prompts: list[list[int]], kv: str, group: int) -> list[list[int]]:
    """NEW_TOKENS greedy tokens after each prompt, `group` sequences decoding together."""
    out = []
    for i in range(0, len(prompts), group):
        part = prompts[i:i + group]
        run = PagedRun(model, len(part), max(map(len, part)) + NEW_TOKENS, kv)
        logits = run.step(part)
        last = torch.tensor([len(p) for p in part]).cumsum(0) - 1
        toks = [[t] for t in logits[last].argmax(-1).tolist()]
        for _ in range(NEW_TOKENS - 1):
            nxt = run.step([[t[-1]] for t in toks]).argmax(-1).tolist()
            for t, n in zip(toks, nxt):
                t.append(n)
        out += toks
    return out


def kl_per_position(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(other)) per row of logits [n, vocab] -> [n]."""
    lp, lq = ref.log_softmax(-1), other.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


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


# name -> (model, kv cache dtype, passages per forward, continuations per forward, twin): a
# scheme with a twin is the twin at another batch size (the noise floor)
VARIANTS = {
    "float32": ("float32", "auto", 1, 16, None),
    "bf16": ("bf16", "auto", 1, 16, None),
    "bf16, other batch": ("bf16", "auto", CHUNK, 5, "bf16"),
    "fp8": ("fp8", "auto", 1, 16, None),
    "fp8 + fp8 KV": ("fp8", "fp8", 1, 16, None),
    "bf16 + fp8 KV": ("bf16", "fp8", 1, 16, None),
    "int8": ("int8", "auto", 1, 16, None),
}


def build_models(device: str, int4: bool) -> tuple[dict, dict]:
    """The models the variants run (by name), and the variants (with the int4 ones if asked)."""
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model
    from pagedserve.quantization import resolve_quantization

    source = resolve_model(None)
    specs = {"float32": (source, "float32", None), "bf16": (source, "bfloat16", None),
             "fp8": (source, "bfloat16", "fp8"), "int8": (source, "bfloat16", "int8")}
    variants = dict(VARIANTS)
    if int4:
        tmp = Path(tempfile.mkdtemp())
        for fmt in ("awq", "gptq"):
            folder = resolve_model(str(int4_checkpoint(tmp, fmt)))
            name = f"{fmt} int4 g64{' sym' if fmt == 'gptq' else ''}"
            specs[name] = (folder, "bfloat16", resolve_quantization(None, folder.hf_config))
            variants[name] = (name, "auto", 1, 16, None)
    models = {k: build_model(src, dtype=dt, device=device, quantization=q) for k, (src, dt, q) in specs.items()}
    return models, variants


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--int4", action="store_true", help="also the 4-bit AWQ and GPTQ checkpoints")
    p.add_argument("--per-kind", type=int, default=1500, help="positions of each kind of text: "
                   "its passages in order until they reach this many (0: every passage)")
    p.add_argument("--prompts", type=int, default=16, help="greedy continuations (a quarter of "
                   "them of each kind of text)")
    p.add_argument("--limit", type=int, default=None, help="a smoke run: this many passages of "
                   "each kind and prompts in all")
    args = p.parse_args()

    from pagedserve.bench.run_info import device_name, git_commit
    from pagedserve.models.source import resolve_model
    from pagedserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model(None).folder)
    models, variants = build_models(args.device, args.int4)
    # per variant: kind -> lists of per-position tensors ("hit", "kl", "twin_hit", "twin_kl"), nll
    acc = {v: {k: {"hit": [], "kl": [], "twin_hit": [], "twin_kl": [], "nll": 0.0, "n": 0}
               for k in quality_texts.KINDS} for v in variants}
    seconds = dict.fromkeys(variants, 0.0)
    prompts = quality_texts.continuation_prompts(tokenizer, -(-args.prompts // 4))[:args.limit]
    conts: dict[str, list[list[int]]] = {}  # filled after the teacher-forced runs

    def changed(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
        """Share of continuations that differ, and the mean count of leading tokens that agree."""
        same = [next((k for k, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)]
        return sum(n < NEW_TOKENS for n in same) / len(same), sum(same) / len(same)

    def write(done: list[str]) -> None:
        """Print the rows over the kinds of text `done` so far; write them to --out."""
        rows, bf16_hit = [], torch.cat([h for k in done for h in acc["bf16"][k]["hit"]])
        for name, (_, _, _, _, twin) in variants.items():
            per = acc[name]
            hit = torch.cat([h for k in done for h in per[k]["hit"]])  # [positions]
            kl = torch.cat([h for k in done for h in per[k]["kl"]])  # [positions]
            agree, se = mean_and_error(hit)
            kl_mean, kl_se = mean_and_error(kl)
            nll = sum(per[k]["nll"] for k in done) / sum(per[k]["n"] for k in done)
            share, lead = changed(conts[name], conts["float32"]) if conts else (None, None)
            row = {"variant": name, "positions": hit.numel(),
                   "agreement_with_float32": round(agree, 4), "standard_error": round(se, 4),
                   "mean_kl_vs_float32": float(f"{kl_mean:.3g}"), "kl_standard_error": float(f"{kl_se:.2g}"),
                   "perplexity": round(math.exp(nll), 3),
                   "changed_greedy_continuations": share, "mean_tokens_before_change": lead,
                   "by_kind": {k: {"positions": int(sum(h.numel() for h in per[k]["hit"])),
                                   "agreement": round(torch.cat(per[k]["hit"]).mean().item(), 4),
                                   "mean_kl": float(f"{torch.cat(per[k]['kl']).mean().item():.3g}")}
                               for k in done},
                   "seconds": round(seconds[name], 1)}
            line = (f"{name:<22} agreement {agree:7.2%} +- {se:.2%}  KL {kl_mean:.2e}  ppl {row['perplexity']:7.3f}"
                    + (f"  greedy changed {share:6.1%}" if conts else ""))
            if name not in ("float32", "bf16"):
                diff, diff_se = mean_and_error(hit - bf16_hit)  # paired on the same positions
                row["minus_bf16"], row["minus_bf16_standard_error"] = round(diff, 4), round(diff_se, 4)
                line += f"  vs bf16 {diff:+7.2%} +- {diff_se:.2%}"
            if twin is not None:
                th = torch.cat([h for k in done for h in per[k]["twin_hit"]])
                tk = torch.cat([h for k in done for h in per[k]["twin_kl"]])
                tshare = changed(conts[name], conts[twin])[0] if conts else None
                row["against_itself"] = {"twin": twin, "agreement": round(th.mean().item(), 4),
                                         "mean_kl": float(f"{tk.mean().item():.3g}"),
                                         "changed_greedy_continuations": tshare}
                line += f"  | vs {twin}: {th.mean().item():.2%}, KL {tk.mean().item():.2e}"
            rows.append(row)
            print(line, flush=True)
        result = {"benchmark": "quant_quality", "model": "SmolLM2-135M-Instruct (embedded, real weights)",
                  "texts": {k: f"benchmarks/quality_texts.py ({k})" for k in done},
                  "kinds_done": done, "greedy_done": bool(conts),
                  "positions": rows[0]["positions"], "greedy_prompts": len(prompts), "greedy_tokens": NEW_TOKENS,
                  "device": "CPU" if args.device == "cpu" else device_name(args.device), "commit": git_commit(),
                  "command": " ".join(["python", "benchmarks/quant_quality.py", *sys.argv[1:]]),
                  "note": ("CPU: FP8 runs its dequantizing reference path (e4m3 weights and activations, bf16 "
                           "products), INT8 torch._int_mm (exact int32 sums). GPU kernels sum in another "
                           "order (and FP8 on Hopper tensor cores), so GPU figures differ slightly."),
                  "rows": rows}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}))

    for kind in quality_texts.KINDS:
        docs = quality_texts.first_positions(quality_texts.encoded(tokenizer, kind), args.per_kind)[:args.limit]
        for i in range(0, len(docs), CHUNK):
            part, kept = docs[i:i + CHUNK], {}
            for name, (model, kv, group, _, twin) in variants.items():
                t0 = time.perf_counter()
                logits = teacher_forced(models[model], part, kv, group)
                seconds[name] += time.perf_counter() - t0
                kept[name] = logits
                a = acc[name][kind]
                for j, (ids, lg) in enumerate(zip(part, logits)):
                    ref = kept["float32"][j]
                    a["hit"].append((lg.argmax(-1) == ref.argmax(-1)).float().cpu())
                    a["kl"].append(kl_per_position(ref, lg).cpu())
                    target = torch.tensor(ids[1:], device=lg.device)
                    a["nll"] += torch.nn.functional.cross_entropy(lg[:-1], target, reduction="sum").item()
                    a["n"] += len(ids) - 1
                    if twin is not None:
                        a["twin_hit"].append((lg.argmax(-1) == kept[twin][j].argmax(-1)).float().cpu())
                        a["twin_kl"].append(kl_per_position(kept[twin][j], lg).cpu())
                if name not in ("float32", "bf16"):
                    del kept[name]
        print(f"{kind}: {sum(map(len, docs))} positions in {len(docs)} passages", flush=True)
        write(list(quality_texts.KINDS[:quality_texts.KINDS.index(kind) + 1]))
    for name, (model, kv, _, group, _) in variants.items():
        t0 = time.perf_counter()
        conts[name] = greedy(models[model], [ids for _, ids in prompts], kv, group)
        seconds[name] += time.perf_counter() - t0
        print(f"{name}: {len(prompts)} greedy continuations in {seconds[name]:.0f} s", flush=True)

    write(list(quality_texts.KINDS))


if __name__ == "__main__":
    main()
