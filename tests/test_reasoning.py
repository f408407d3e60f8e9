"""Tests for the ``<think>...</think>`` reasoning parser (pure Python, no torch)."""

from __future__ import annotations

import itertools
import random

import pytest

from pagedserve.server.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    get_reasoning_parser,
)

# (text, starts_in_reasoning, expected reasoning, expected content)
EXTRACT_CASES = [
    ("<think>why</think>answer", False, "why", "answer"),
    ("<think>\nwhy\n</think>\n\nanswer\n", False, "\nwhy\n", "answer\n"),
    ("  \n<think>r</think>c", False, "r", "c"),
    ("<think></think>answer", False, None, "answer"),
    ("<think>r</think>", False, "r", None),
    ("<think>r</think>\n\n", False, "r", None),
    ("<think>out of tokens", False, "out of tokens", None),
    ("<think>", False, None, None),
    ("plain answer", False, None, "plain answer"),
    ("", False, None, None),
    ("  \n", False, None, "  \n"),
    ("a <think>x</think> b", False, None, "a <think>x</think> b"),
    ("<thin", False, None, "<thin"),
    ("1 < 2 and <b>", False, None, "1 < 2 and <b>"),
    ("<think>a<think>b</think>c", False, "a<think>b", "c"),
    ("<think>a</think>b</think>c<think>", False, "a", "b</think>c<think>"),
    ("<think>x < y </thin</think> z", False, "x < y </thin", " z"),
    ("<think>r</think> \ncontent", False, "r", " \ncontent"),
    ("<think>r</think>\r\ncontent", False, "r", "content"),
    # the chat template opened <think> in the prompt
    ("why</think>answer", True, "why", "answer"),
    ("</think>answer", True, None, "answer"),
    ("\nwhy\n</think>\nanswer", True, "\nwhy\n", "answer"),
    ("<think>why</think>answer", True, "why", "answer"),
    ("still thinking", True, "still thinking", None),
    ("  ", True, "  ", None),
    ("<th", True, "<th", None),
    ("", True, None, None),
]

ALPHABET = ["<think>", "</think>", "<", "</", "<th", "</thi", ">", "k", "t", "a", " ", "\n", "/"]


def run_stream(text: str, cuts: tuple[int, ...], starts_in_reasoning: bool) -> tuple[str, str]:
    """Feed ``text`` split at ``cuts`` through a fresh parser; return the joined outputs."""
    parser = ReasoningParser(starts_in_reasoning)
    reasoning, content = [], []
    bounds = (0, *cuts, len(text))
    for lo, hi in itertools.pairwise(bounds):
        r, c = parser.stream(text[lo:hi])
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


def check_all_splits(text: str, starts_in_reasoning: bool) -> None:
    """Every split of ``text`` (all 2**(n-1) cut sets) streams to ``extract``'s result."""
    expected = ReasoningParser(starts_in_reasoning).extract(text)
    want = (expected[0] or "", expected[1] or "")
    for count in range(len(text)):
        for cuts in itertools.combinations(range(1, len(text)), count):
            assert run_stream(text, cuts, starts_in_reasoning) == want, (text, cuts)


@pytest.mark.parametrize("text,sir,reasoning,content", EXTRACT_CASES)
def test_extract(text: str, sir: bool, reasoning: str | None, content: str | None) -> None:
    assert ReasoningParser(starts_in_reasoning=sir).extract(text) == (reasoning, content)


@pytest.mark.parametrize("text,sir,reasoning,content", EXTRACT_CASES)
def test_stream_matches_extract_every_split(
    text: str, sir: bool, reasoning: str | None, content: str | None
) -> None:
    if len(text) > 14:  # keep 2**(n-1) manageable; longer cases: a sample of splits
        rng = random.Random(text)
        for _ in range(300):
            cuts = tuple(sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1))))
            assert run_stream(text, cuts, sir) == (reasoning or "", content or "")
        for size in (1, 2, 3):  # fixed-size chunks, including one char at a time
            cuts = tuple(range(size, len(text), size))
            assert run_stream(text, cuts, sir) == (reasoning or "", content or "")
    else:
        check_all_splits(text, sir)


@pytest.mark.parametrize("sir", [False, True])
def test_stream_exhaustive_short_texts(sir: bool) -> None:
    rng = random.Random(1234 + sir)
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6)))[:12]
        check_all_splits(text, sir)


@pytest.mark.parametrize("sir", [False, True])
def test_stream_random_long_texts(sir: bool) -> None:
    rng = random.Random(99 + sir)
    for _ in range(400):
        prefix = rng.choice(["", " ", "\n", "<think>", " \n<think>", "<thi"])
        text = prefix + "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))
        expected = ReasoningParser(sir).extract(text)
        want = (expected[0] or "", expected[1] or "")
        for _ in range(20):
            n = rng.randint(0, max(0, len(text) - 1))
            cuts = tuple(sorted(rng.sample(range(1, len(text)), n))) if len(text) > 1 else ()
            assert run_stream(text, cuts, sir) == want, (text, cuts)


def test_stream_never_emits_tags_and_holds_partials() -> None:
    parser = ReasoningParser()
    assert parser.stream("<th") == ("", "")
    assert parser.stream("ink>") == ("", "")
    assert parser.stream("hmm </") == ("hmm ", "")
    assert parser.stream("b") == ("</b", "")
    assert parser.stream(" x</thi") == (" x", "")
    assert parser.stream("nk>\n") == ("", "")
    assert parser.stream("\nThe answer") == ("", "The answer")
    assert parser.stream("\n</think>") == ("", "\n</think>")
    assert parser.finish() == ("", "")


def test_stream_no_tag_is_content_immediately() -> None:
    parser = ReasoningParser()
    assert parser.stream(" ") == ("", "")  # could still be whitespace before <think>
    assert parser.stream("Hi") == ("", " Hi")
    assert parser.stream("<think>") == ("", "<think>")
    assert parser.finish() == ("", "")


def test_stream_unfinished_reasoning_flushes_partial_tag() -> None:
    parser = ReasoningParser(starts_in_reasoning=True)
    assert parser.stream("abc</th") == ("abc", "")
    assert parser.finish() == ("</th", "")


def test_registry() -> None:
    assert set(REASONING_PARSERS) >= {"think", "deepseek_r1", "qwen3", "nanbeige"}
    for name in ("think", "deepseek_r1", "qwen3", "nanbeige"):
        cls = get_reasoning_parser(name)
        assert issubclass(cls, ReasoningParser)
        assert cls().extract("<think>r</think>c") == ("r", "c")
    with pytest.raises(ValueError, match="deepseek_r1.*nanbeige.*qwen3.*think"):
        get_reasoning_parser("nope")
