"""Which replica (a Ray Serve replica of `serve-ray`, or an engine core of `serve
--data-parallel-size`) a request goes to (torch-free, Ray-free).

A conversation's later turns resend its earlier ones, so the replica that served turn n holds
turn n+1's longest prefix in its KV prefix cache. The policy remembers, per conversation, the
replica it last went to, and keeps it there while that replica is not much busier than the
least loaded one; a new conversation (or one whose replica got too busy, or went away) goes to
the least loaded replica, ties broken by a hash of the conversation (so equal replicas share
new conversations evenly and every router breaks a tie the same way).

A conversation is named by what stays the same across its turns: a chat's messages up to and
including the first user message; a completion's first `PROMPT_KEY_CHARS` characters (or
first 256 token ids). OpenAI's `prompt_cache_key`, when a request gives one, names it instead:
requests with the same key go to the same place whatever their messages.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

PROMPT_KEY_CHARS = 1024


def conversation_key(body: Mapping) -> str | None:
    """The key of the conversation an OpenAI request body belongs to; None: nothing to key on.
    Chat `messages` and the Responses API's `input` items count up to and including the first
    user message (with the `instructions`); a prompt (text or token ids) by its beginning. A
    non-empty `prompt_cache_key` (a string) names the conversation instead."""
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        return hashlib.blake2b(f"prompt_cache_key|{cache_key}".encode(), digest_size=12).hexdigest()
    messages = body.get("messages")
    if messages is None and isinstance(body.get("input"), list):
        messages = body["input"]
    if isinstance(messages, list) and messages:
        head = [body.get("instructions")]
        for message in messages:
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        text = json.dumps(head, sort_keys=True, default=str)
    else:
        prompt = body.get("prompt", body.get("input"))
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # (a batch of prompts: by its first)
        if not isinstance(prompt, (str, list)) or not prompt:
            return None
        text = json.dumps(prompt[:PROMPT_KEY_CHARS] if isinstance(prompt, str) else prompt[:256])
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _tie_break(key: str | None, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest()


@dataclass
class AffinityPolicy:
    """Least load, with conversations kept on their replica.

    `max_imbalance`: how many more ongoing requests than the least loaded replica a
    conversation's replica may have and still keep it. `capacity`: conversations remembered
    (least recently routed forgotten first)."""

    max_imbalance: int = 4
    capacity: int = 100_000
    kept: int = 0  # requests of a known conversation routed to its replica
    moved: int = 0  # requests of a known conversation routed elsewhere (busy or gone)
    new: int = 0  # requests of conversations not seen (or not keyed)
    _where: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def choose(self, key: str | None, loads: Mapping[str, int | None]) -> list[str]:
        """`loads`: ongoing requests per candidate replica (None: not known). The replicas in
        order of preference (the first is the choice; the rest are fallbacks)."""
        if not loads:
            return []
        known = [n for n in loads.values() if n is not None]
        least = min(known) if known else 0
        by_load = sorted(loads, key=lambda r: (loads[r] if loads[r] is not None else least,
                                               _tie_break(key, r)))
        home = self._where.get(key) if key is not None else None
        if home is not None and home in loads:
            load = loads[home]
            if load is None or load - least <= self.max_imbalance:
                return [home] + [r for r in by_load if r != home]
        return by_load

    def routed(self, key: str | None, replica: str) -> None:
        """Record where a request of conversation `key` went (and count it)."""
        home = self._where.get(key) if key is not None else None
        if home is None:
            self.new += 1
        elif home == replica:
            self.kept += 1
        else:
            self.moved += 1
        if key is None:
            return
        self._where[key] = replica
        self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget_replica(self, replica: str) -> None:
        """A replica is gone: its conversations go elsewhere next time."""
        for key in [k for k, r in self._where.items() if r == replica]:
            del self._where[key]
