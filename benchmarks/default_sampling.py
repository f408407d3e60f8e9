"""Sampling settings for the embedded SmolLM2-135M-Instruct (4-bit), measured (issue 57).

A dozen everyday questions, each with the word a right answer contains; every setting answers
each question `SAMPLES` times (seeded), on the CPU with the real embedded model. Per setting:
the share of answers that contain the right word, the share that repeat themselves (a 4-word
sequence three times or more) and the mean answer length. Prints one JSON object as its last
line and writes it to benchmarks/results/default_sampling.json.

    python benchmarks/default_sampling.py [samples] [max_tokens]
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

QUESTIONS = [  # (question, a word every right answer contains; alternatives joined by |)
    ("What is the capital of France?", "paris"),
    ("How many days are in a week?", "seven|7"),
    ("What color is the sky on a clear day?", "blue"),
    ("What is 2 + 2?", "four|4"),
    ("Who wrote Romeo and Juliet?", "shakespeare"),
    ("What is the largest planet in our solar system?", "jupiter"),
    ("What do bees make?", "honey"),
    ("At what temperature in Celsius does water boil at sea level?", "100"),
    ("How many legs does a spider have?", "eight|8"),
    ("What language do people speak in Spain?", "spanish"),
    ("What is the capital of Japan?", "tokyo"),
    ("Which animal is called the king of the jungle?", "lion"),
]
SETTINGS = [  # (temperature, top_p); (0, 1): greedy, answered once (it is deterministic)
    (0.0, 1.0), (0.2, 0.9), (0.3, 0.9), (0.5, 0.9), (0.7, 1.0), (1.0, 1.0),
]
MAX_TOKENS = 96  # (the second argument; a right answer names its word in the first sentence)
OUT = Path(__file__).resolve().parent / "results" / "default_sampling.json"


def right(answer: str, words: str) -> bool:
    return re.search(rf"\b({words})\b", answer.lower()) is not None


def repetitive(answer: str) -> bool:
    words = answer.lower().split()
    grams = Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3))
    return bool(grams) and max(grams.values()) >= 3


def main() -> int:
    from pagedserve import LLM, SamplingParams

    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else MAX_TOKENS
    # (the KV cache holds every running request whole: 128 x ~130 tokens, no preemption)
    llm = LLM(device="cpu", generation_config="vllm", max_model_len=1024, max_num_seqs=128,
              kv_cache_memory=1 << 30)
    convs, params, keys = [], [], []
    for temperature, top_p in SETTINGS:
        for q, words in QUESTIONS:
            for seed in range(1 if temperature == 0 else samples):
                convs.append([{"role": "user", "content": q}])
                params.append(SamplingParams(temperature=temperature, top_p=top_p, seed=seed,
                                             max_tokens=max_tokens))
                keys.append((temperature, top_p, q, words))
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    rows: dict[tuple[float, float], list[tuple[str, str, str]]] = {}
    for (temperature, top_p, q, words), out in zip(keys, outs, strict=True):
        rows.setdefault((temperature, top_p), []).append((q, words, out.outputs[0].text))
    results = []
    for (temperature, top_p), answers in rows.items():
        n = len(answers)
        results.append({
            "temperature": temperature, "top_p": top_p, "answers": n,
            "right": round(sum(right(a, w) for _, w, a in answers) / n, 3),
            "repetitive": round(sum(repetitive(a) for _, _, a in answers) / n, 3),
            "mean_words": round(sum(len(a.split()) for _, _, a in answers) / n, 1),
            "example_capital_of_france": next(a for q, _, a in answers if "France" in q)[:200],
        })
    summary = {"model": "embedded SmolLM2-135M-Instruct (Q4_1 GGUF, fp32 on the CPU)",
               "questions": len(QUESTIONS), "samples_per_question": samples,
               "max_tokens": max_tokens, "seconds": round(seconds, 1), "settings": results}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(summary, indent=2) + "\n")
    for r in results:
        print(f"T={r['temperature']:<4} top_p={r['top_p']:<4} right {r['right']:.0%} "
              f"repetitive {r['repetitive']:.0%} words {r['mean_words']}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
