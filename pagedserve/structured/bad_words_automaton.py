"""vLLM's `bad_words` as an Aho-Corasick automaton over token ids (plain Python, no torch: the
HTTP process builds it, the engine walks it).

A bad word is a token sequence. Before each sampled token, the last token of every sequence
whose other tokens end the output so far is banned (a one-token sequence always is), so the
output never completes one. Scanning every sequence at every token costs the number of words
per token (30,000 words: 11 ms a token); the automaton costs what is actually matched.

The trie holds every sequence but its last token (a sequence `p + [t]` puts `t` into the
`ends` of node `p`). A request's state is the trie node of the longest suffix of its output
that is in the trie; the suffixes of the output that are in the trie are that node and the
nodes down its failure links, so the tokens banned next are the `ends` of those nodes. Each
node keeps an output link to the nearest node down its failure chain with `ends`, so reading
the bans visits only nodes that ban something. The root's `ends` (the one-token words) are
banned at every step: they are kept as a ready bitmask row (`always_mask`).

Everything is kept in flat int32 arrays (children in CSR form, sorted by token): the
automaton pickles as a few byte strings (no per-node Python objects to rebuild in the engine)
and is shared by every sample of a request.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Generator, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")
Steps = Generator[None, None, T]  # a computation that pauses (yields) between slices of its work

# units of work (sequences taken, tokens inserted, nodes linked) between two pauses: 1-3 ms
SLICE = 1024
_LOW = (1 << 32) - 1  # an end key's token: its low 32 bits


def run_steps(steps: Steps[T]) -> T:
    """Run a computation given as steps to its end, without pausing; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _ints(values: Iterable[int] = ()) -> array:
    return array("i", values)


class BadWordsAutomaton:
    """The bad words of one request, compiled. Build with `build` (or `build_steps`); read
    with `step`, `banned_after` and `always_mask`."""

    def __init__(self, child_off: array, child_tok: array, fail: array, out: array,
                 ends_off: array, ends_tok: array, always: array, always_mask: array,
                 max_token: int, num_sequences: int) -> None:
        # node k's children: tokens child_tok[child_off[k]:child_off[k + 1]] (sorted); the
        # edge at index i leads to node i + 1 (breadth-first numbering)
        self.child_off, self.child_tok = child_off, child_tok
        self.fail, self.out = fail, out  # failure link; nearest node down it with ends (-1: none)
        self.ends_off, self.ends_tok = ends_off, ends_tok  # per node: the tokens it bans
        self.always = always  # the root's ends: the one-token words' tokens
        # int32 bitmask words with the bit of every `always` token cleared, as far as the
        # highest of them reaches; the words after it are all ones
        self.always_mask = always_mask
        self.max_token = max_token  # the highest token id of any sequence (-1: none)
        self.num_sequences = num_sequences

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]]) -> BadWordsAutomaton:
        """Compile token sequences (non-empty lists of ids >= 0, as `SamplingParams` checks
        them; repeats allowed). Linear in their total length."""
        return run_steps(cls.build_steps(sequences))

    @classmethod
    def build_steps(cls, sequences: Iterable[Sequence[int]]) -> Steps[BadWordsAutomaton]:
        """`build`, pausing after every SLICE units of work (the server runs it on its event
        loop, other requests between the slices). The trie's dicts hold ints only, which the
        garbage collector does not track: a build adds nothing for it to walk (30,000 words
        of sets or lists set off full collections of 100 ms and more)."""
        children: list[dict[int, int] | None] = [None]
        end_keys: list[int] = []  # (node << 32 | token): the token ends a sequence at the node
        max_token, count, work = -1, 0, 0
        for seq in sequences:
            if not seq:
                raise ValueError("bad_words_token_ids must not hold an empty sequence")
            count += 1
            max_token = max(max_token, max(seq))
            node = 0
            work += 1
            for i in range(len(seq) - 1):
                kids = children[node]
                if kids is None:
                    kids = children[node] = {}
                nxt = kids.get(seq[i])
                if nxt is None:
                    nxt = kids[seq[i]] = len(children)
                    children.append(None)
                node = nxt
                work += 1
                if work >= SLICE:
                    work = 0
                    yield
            end_keys.append(node << 32 | seq[-1])
        end_keys.sort()
        return (yield from cls._compile(children, end_keys, max_token, count))

    @classmethod
    def _compile(cls, children: list[dict[int, int] | None], end_keys: list[int],
                 max_token: int, count: int) -> Steps[BadWordsAutomaton]:
        """One breadth-first pass: number the nodes, children by token (so node k's children
        are the nodes child_off[k] + 1 .. child_off[k + 1]: edge i leads to node i + 1), and
        give each its failure and output links (those of shallower nodes are known).
        `end_keys`: sorted. Everything per node is kept in arrays, so nothing is converted
        or freed an object at a time at the end."""
        n = len(children)
        ends_at: dict[int, int] = {}  # node that ends a sequence -> the index of its last end key
        for i, k in enumerate(end_keys):
            ends_at[k >> 32] = i
            if i % SLICE == SLICE - 1:
                yield
        # (trie ids in breadth-first order; the order of a trie id; failure links by trie id)
        order, new, fail = _ints([0]), _ints(bytes(4 * n)), _ints(bytes(4 * n))
        child_off, child_tok, fail_new, out = _ints([0]), _ints(), _ints([0]), _ints([-1])
        ends_off, ends_tok = _ints([0]), _ints()
        for u in order:  # (grows while iterated)
            i = ends_at.get(u, -1) if u else -1
            while i >= 0 and end_keys[i] >> 32 == u:
                if ends_off[-1] == len(ends_tok) or ends_tok[-1] != end_keys[i] & _LOW:
                    ends_tok.append(end_keys[i] & _LOW)  # (repeats are adjacent: dropped)
                i -= 1
            ends_off.append(len(ends_tok))
            kids = children[u]
            if kids:
                for t in sorted(kids):
                    v = kids[t]
                    fv = 0
                    if u:  # (the root's children fail to the root)
                        f = fail[u]
                        while True:
                            fk = children[f]
                            if fk is not None and t in fk:
                                fv = fk[t]
                                break
                            if f == 0:
                                break
                            f = fail[f]
                    fail[v], new[v] = fv, len(order)
                    order.append(v)
                    child_tok.append(t)
                    f = new[fv]
                    fail_new.append(f)
                    out.append(f if fv and fv in ends_at else out[f])
                    if len(order) % SLICE == 0:
                        yield
            child_off.append(len(child_tok))
        always = _ints(sorted({k & _LOW for k in end_keys[:bisect_left(end_keys, 1 << 32)]}))
        always_mask = yield from _always_mask(always)
        for start in range(0, n, SLICE):  # (the trie's dicts freed a slice at a time)
            children[start:start + SLICE] = [None] * len(children[start:start + SLICE])
            yield
        return cls(child_off, child_tok, fail_new, out, ends_off, ends_tok, always, always_mask,
                   max_token, count)

    @property
    def num_nodes(self) -> int:
        return len(self.fail)

    def step(self, state: int, token: int) -> int:
        """The state after `token` is appended to an output in `state` (0: the empty
        output). Amortized O(1) a token; at most the longest sequence's length."""
        child_off, child_tok = self.child_off, self.child_tok
        while True:
            lo, hi = child_off[state], child_off[state + 1]
            if lo < hi:
                i = bisect_left(child_tok, token, lo, hi)
                if i < hi and child_tok[i] == token:
                    return i + 1
            if state == 0:
                return 0
            state = self.fail[state]

    def banned_after(self, state: int) -> list[int]:
        """The tokens banned in `state` besides the `always` ones: the last tokens of the
        sequences longer than one whose other tokens end the output."""
        found: list[int] = []
        node = state if state != 0 and self.ends_off[state] < self.ends_off[state + 1] else self.out[state]
        while node > 0:
            found.extend(self.ends_tok[self.ends_off[node]:self.ends_off[node + 1]])
            node = self.out[node]
        return found

    def banned(self, state: int) -> set[int]:
        """Every token banned in `state` (for tests and the reference)."""
        return set(self.always) | set(self.banned_after(state))


def _always_mask(always: array) -> Steps[array]:
    """Bitmask words (int32, bit t % 32 of word t // 32) with the `always` tokens cleared, up
    to the word of the highest one."""
    if not always:
        return _ints()
    words = [0xFFFFFFFF] * (always[-1] // 32 + 1)
    for i, t in enumerate(always):
        words[t >> 5] &= ~(1 << (t & 31))
        if i % SLICE == SLICE - 1:
            yield
    return _ints(w - (1 << 32) if w >= 1 << 31 else w for w in words)
