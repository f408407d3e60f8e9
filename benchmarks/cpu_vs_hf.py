"""pagedserve against Transformers on the CPU (issue 30's CPU target): the embedded SmolLM2
in float32, B prompts at once, 128 greedy tokens each (EOS ignored), tokens per second of the
whole generate call (prefill included), each engine warmed up first.

    python benchmarks/cpu_vs_hf.py [--batch-sizes 1,8] [--max-tokens 128] [--rounds 2] [--json OUT]

Transformers runs `model.generate` on the left-padded batch (its default cache), the way a
FastAPI handler around it would; pagedserve runs `LLM.generate`. The rounds alternate the two
engines; the best round of each counts (the machine's other load only slows a round).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import torch

PROMPTS = [f"Write a short story about a dragon who collects {thing}." for thing in
           ("teapots", "maps", "old coins", "feathers", "clocks", "seashells", "keys", "books",
            "lanterns", "stamps", "marbles", "kites", "spoons", "hats", "bells", "pebbles")]


def _chat(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def run_pagedserve(llm, prompts: list[str], max_tokens: int) -> float:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return len(prompts) * max_tokens / seconds


def run_transformers(model, tokenizer, prompts: list[str], max_tokens: int) -> float:
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - t0
    assert out.shape[1] - batch["input_ids"].shape[1] == max_tokens
    return len(prompts) * max_tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve import LLM
    from pagedserve.models.default_model import default_model_dir

    folder = default_model_dir()
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=2048)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = [_chat(tokenizer, p) for p in PROMPTS]
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = (texts * (bs // len(texts) + 1))[:bs]
        run_pagedserve(llm, prompts, 8)  # (warm-up)
        run_transformers(model, tokenizer, prompts, 8)
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(run_pagedserve(llm, prompts, args.max_tokens))
            theirs.append(run_transformers(model, tokenizer, prompts, args.max_tokens))
        row = {"batch": bs, "pagedserve_tok_s": round(max(ours), 2), "transformers_tok_s": round(max(theirs), 2),
               "ratio": round(max(ours) / max(theirs), 3), "rounds": {"pagedserve": ours, "transformers": theirs}}
        rows.append(row)
        print(f"batch {bs:>3}: pagedserve {row['pagedserve_tok_s']:7.1f} tok/s  transformers "
              f"{row['transformers_tok_s']:7.1f} tok/s  ratio {row['ratio']:.2f}", flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cpu_vs_hf", "model": "SmolLM2-135M-Instruct", "dtype": "float32",
                       "max_tokens": args.max_tokens, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                       "cpu": platform.processor() or platform.machine(), "commit": commit,
                       "command": "python benchmarks/cpu_vs_hf.py " + " ".join(
                           f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
