"""Routers' prefix hits on a multi-turn trace: part (b) of the scaling simulation
(`benchmarks/scaling_sim.py` runs it; docs/scaling.md).

Conversations start as a Poisson process; every one shares a system prompt and has several
turns, each turn's prompt being the whole conversation so far plus a new user message, and
the next turn coming a think time after the answer. Each of R replicas holds an LRU prefix
cache of `kv_tokens` tokens, kept at the level of "what of this conversation is cached here":
the system prompt (shared, stored once) and, per conversation, the tokens up to the end of
the last turn this replica served (a prefix of every later turn). A request's hit is the
system prompt plus that conversation's cached tokens on the replica it is routed to. A
request takes TTFT(n) + (out - 1) TPOT(n) with n its replica's ongoing requests when it
starts, from the serving curves passed in (cache hits do not shorten it). Routers: random,
least loaded (ongoing requests), and the project's `AffinityPolicy` with `conversation_key`
(`pagedserve/server/affinity.py`, used as the Ray Serve router uses it).

Not modelled: prefill saved by cache hits, KV taken by running requests from the cache.
"""

from __future__ import annotations

import heapq
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout
    sys.path.insert(0, str(ROOT))

from pagedserve.server.affinity import AffinityPolicy, conversation_key  # noqa: E402


class ServingCurves(Protocol):
    """One replica's serving curves (`scaling_sim.Curves`)."""

    def per_n(self, max_n: int) -> tuple[list[float], list[float]]:
        """TTFT(n) and TPOT(n) in seconds for n = 0..max_n."""
        ...


@dataclass(frozen=True)
class TraceConfig:
    conversations: int = 8_000
    conv_rate: float = 7.0  # conversation starts per second (Poisson)
    min_turns: int = 2
    max_turns: int = 8  # turns per conversation: uniform in [min_turns, max_turns]
    system_tokens: int = 1_000  # one system prompt shared by every conversation
    user_tokens: tuple[int, int] = (50, 400)  # a user message: uniform in this range
    answer_tokens: tuple[int, int] = (100, 500)  # an answer (output tokens): uniform
    think_s: float = 30.0  # mean (exponential) time from an answer to the next user message
    seed: int = 0


@dataclass
class Conversation:
    start: float
    user: list[int]
    answer: list[int]
    think: list[float]  # think[k]: before turn k + 1


def make_trace(cfg: TraceConfig) -> list[Conversation]:
    rng = np.random.default_rng(cfg.seed)
    starts = np.cumsum(rng.exponential(1.0 / cfg.conv_rate, cfg.conversations))
    turns = rng.integers(cfg.min_turns, cfg.max_turns + 1, cfg.conversations)
    trace = []
    for start, k in zip(starts.tolist(), turns.tolist()):
        trace.append(Conversation(
            start, rng.integers(cfg.user_tokens[0], cfg.user_tokens[1] + 1, k).tolist(),
            rng.integers(cfg.answer_tokens[0], cfg.answer_tokens[1] + 1, k).tolist(),
            rng.exponential(cfg.think_s, k).tolist()))
    return trace


class _Lru:
    """A replica's prefix cache: entry -> tokens, least recently used evicted first."""

    SYSTEM = "\x00system"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.entries: OrderedDict[object, int] = OrderedDict()

    def put(self, key: object, tokens: int) -> None:
        self.used += tokens - self.entries.get(key, 0)
        self.entries[key] = tokens
        self.entries.move_to_end(key)
        while self.used > self.capacity and self.entries:
            _, size = self.entries.popitem(last=False)
            self.used -= size


ROUTERS = ("random", "least-loaded", "affinity")


def simulate_routing(trace: list[Conversation], router: str, replicas: int, cfg: TraceConfig,
                     *, kv_tokens: int, curves: ServingCurves, warmup_s: float | None = None,
                     seed: int = 0, max_num_seqs: int = 256) -> dict:
    """Route every turn of `trace` onto `replicas` replicas of `kv_tokens` cached tokens each,
    serving at `curves`; prefix-hit rate and load spread over the requests that arrive
    between `warmup_s` (default: a fifth of the conversation starts' span) and the last
    conversation's start (after it the load drains)."""
    if router not in ROUTERS:
        raise ValueError(f"router {router!r}: one of {ROUTERS}")
    ttft_n, tpot_n = curves.per_n(max_num_seqs)
    names = [f"replica-{i}" for i in range(replicas)]
    policy = AffinityPolicy() if router == "affinity" else None
    pick = random.Random(seed)
    caches = [_Lru(kv_tokens) for _ in range(replicas)]
    ongoing = [0] * replicas
    system = {"role": "system", "content": "You are a helpful assistant."}
    last_start = trace[-1].start
    warmup = last_start / 5 if warmup_s is None else warmup_s
    S = cfg.system_tokens
    prompt_total = hit_total = ideal_total = system_total = 0
    max_sum = mean_sum = 0.0
    measured = 0
    events: list[tuple] = [(c.start, 1, n, 0) for n, c in enumerate(trace)]  # (t, kind, conv, turn)
    heapq.heapify(events)  # kind 0: a request finishes (before arrivals at the same time)
    seq = 0
    while events:
        now, kind, n, k, *rest = heapq.heappop(events)
        conv = trace[n]
        history = sum(conv.user[:k]) + sum(conv.answer[:k])  # tokens of turns before k
        if kind == 0:  # turn k of conversation n done on replica rest[1]
            i = rest[1]
            ongoing[i] -= 1
            caches[i].put(_Lru.SYSTEM, S)
            caches[i].put(n, history + conv.user[k] + conv.answer[k])
            if k + 1 < len(conv.user):
                heapq.heappush(events, (now + conv.think[k], 1, n, k + 1))
            continue
        if router == "random":
            i = pick.randrange(replicas)
        elif router == "least-loaded":
            least = min(ongoing)
            ties = [j for j, x in enumerate(ongoing) if x == least]
            i = ties[0] if len(ties) == 1 else pick.choice(ties)
        else:
            messages = [system, {"role": "user", "content": f"conversation {n} opens"}]
            for j in range(k):
                messages += [{"role": "assistant", "content": f"answer {j}"},
                             {"role": "user", "content": f"question {j + 1}"}]
            key = conversation_key({"model": "m", "messages": messages})
            choice = policy.choose(key, dict(zip(names, ongoing)))[0]
            policy.routed(key, choice)
            i = names.index(choice)
        if warmup <= now <= last_start:
            measured += 1
            max_sum += max(ongoing)
            mean_sum += sum(ongoing) / replicas
            prompt = S + history + conv.user[k]
            cache = caches[i].entries
            hit = 0
            if _Lru.SYSTEM in cache:
                hit = S + min(cache.get(n, 0), history)
            prompt_total += prompt
            hit_total += hit
            ideal_total += S + history
            system_total += S
        caches[i].put(_Lru.SYSTEM, S)  # in use: most recent
        ongoing[i] += 1
        m = min(ongoing[i], max_num_seqs)
        duration = ttft_n[m] + (conv.answer[k] - 1) * tpot_n[m]
        seq += 1
        heapq.heappush(events, (now + duration, 0, n, k, seq, i))
    result = {
        "router": router, "replicas": replicas, "kv_tokens_per_replica": kv_tokens,
        "requests_measured": measured,
        "prefix_hit_rate": hit_total / prompt_total if prompt_total else 0.0,
        # every turn finding its whole conversation so far (one replica, no eviction)
        "ideal_hit_rate": ideal_total / prompt_total if prompt_total else 0.0,
        # every turn finding only the system prompt
        "system_only_hit_rate": system_total / prompt_total if prompt_total else 0.0,
        "load_spread": max_sum / mean_sum if mean_sum else 1.0,
        "mean_ongoing_per_replica": mean_sum / measured if measured else 0.0,
    }
    if policy is not None:
        result.update(kept=policy.kept, moved=policy.moved, new=policy.new)
    return result
