"""Summarise a `py-spy record --format raw` profile (as `serve_check.sh diag` writes it): per
process, the functions with the most samples on top of the stack (self, with their most
frequent callers) and anywhere in it (inclusive), as percentages of that process's samples.

    python3 benchmarks/pyspy_summary.py pyspy_raw.txt [--top 25] [--focus run_asgi]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict


def summarise(lines: list[str], top: int, focus: str | None = None) -> str:
    """The report; with `focus`, only the samples whose stack holds a frame containing it."""
    self_time: dict[str, Counter] = defaultdict(Counter)
    inclusive: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    callers: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        proc = procs[-1] if procs else "process ?"  # (a child's samples also carry its parents)
        frames = [re.sub(r":\d+\)$", ")", f) for f in frames
                  if not f.startswith(("process ", "thread "))]
        if not frames or (focus and not any(focus in f for f in frames)):
            continue
        totals[proc] += n
        self_time[proc][frames[-1]] += n
        callers[proc][frames[-1]][" <- ".join(reversed(frames[-4:-1]))] += n
        for f in set(frames):
            inclusive[proc][f] += n
    out = []
    for proc, total in totals.most_common():
        out.append(f"== {proc[:140]}: {total} samples")
        # (inclusive leaves out the frames every sample passes through: main, the event loop)
        below_root = Counter({f: n for f, n in inclusive[proc].items() if n < 0.98 * total})
        for title, table in (("self", self_time[proc]), ("inclusive", below_root)):
            out.append(f"  -- {title}")
            for f, n in table.most_common(top):
                out.append(f"  {100 * n / total:5.1f}%  {f[:150]}")
                if title == "self":  # where it was called from, most often
                    chain, m = callers[proc][f].most_common(1)[0]
                    out.append(f"          {100 * m / n:3.0f}% of it from {chain[:220]}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--focus", default=None, help="only stacks with a frame containing this text")
    args = ap.parse_args()
    with open(args.raw) as f:
        print(summarise(f.readlines(), args.top, args.focus))


if __name__ == "__main__":
    main()
