"""Tests for the tool-call parsers (pure Python, no torch, no server)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest

from pagedserve.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedToolCall,
    Phi4MiniJsonToolParser,
    SmolLM2ToolParser,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)

Calls = list[tuple[str, str]]  # (name, arguments) per call


def block(body: str) -> str:
    """A Qwen3-style tool-call block around ``body``."""
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_CALL = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
TIME_CALL = ("get_time", '{"tz": "Europe/Paris"}')
NESTED_ARGS = (
    '{"code": "if (x) { y(); } else {", "opts": {"a": [1, {"b": null}], "c": true},'
    ' "n": -0.5e-3, "z": 0, "big": 12345678901234567890, "e": [], "o": {}}'
)
QUOTES_ARGS = r'{"text": "she said \"hi\" \\ {not a brace} \\\" [", "path": "C:\\dir\\"}'
CLOSE_TAG_ARGS = '{"html": "</tool_call> and <tool_call>", "more": "}]\\"}"}'
UNICODE_ARGS = '{"ville": "Zürich 東京 😀", "esc": "\\u00e9\\ud83d\\ude00", "tab": "a\\tb"}'

# (text, expected content, expected calls) for outputs whose blocks are all valid, or
# invalid before their name is complete: stream and extract agree exactly on these.
HERMES_CASES: list[tuple[str, str | None, Calls]] = [
    (block(WEATHER), None, [WEATHER_CALL]),
    (f"<tool_call>{WEATHER}</tool_call>", None, [WEATHER_CALL]),
    ("Let me check.\n\n" + block(WEATHER), "Let me check.", [WEATHER_CALL]),
    (block(WEATHER) + "\n" + block(TIME), None, [WEATHER_CALL, TIME_CALL]),
    (block(WEATHER) + block(TIME) + "\n", None, [WEATHER_CALL, TIME_CALL]),
    (
        "I'll call two tools.\n" + block(WEATHER) + "\n\n" + block(TIME) + "\n",
        "I'll call two tools.",
        [WEATHER_CALL, TIME_CALL],
    ),
    (block(f'{{"name": "run", "arguments": {NESTED_ARGS}}}'), None, [("run", NESTED_ARGS)]),
    (block(f'{{"name": "say", "arguments": {QUOTES_ARGS}}}'), None, [("say", QUOTES_ARGS)]),
    (block(f'{{"name": "web", "arguments": {CLOSE_TAG_ARGS}}}'), None, [("web", CLOSE_TAG_ARGS)]),
    (
        "Voilà 🌦\n" + block(f'{{"name": "météo", "arguments": {UNICODE_ARGS}}}'),
        "Voilà 🌦",
        [("météo", UNICODE_ARGS)],
    ),
    # "arguments" before "name", the "parameters" synonym, no arguments, extra keys
    (block('{"arguments": {"q": "x"}, "name": "search"}'), None, [("search", '{"q": "x"}')]),
    (block('{"name": "search", "parameters": {"q": 1}}'), None, [("search", '{"q": 1}')]),
    (block('{"parameters": {"q": [1,2]},"name":"search"}'), None, [("search", '{"q": [1,2]}')]),
    (block('{"name": "now"}'), None, [("now", "{}")]),
    (block('{"name": "now", "arguments": {}}'), None, [("now", "{}")]),
    (block('{"id": 7, "name": "f", "x": [1, {"name": "g"}], "arguments": {"a": 1}}'), None,
     [("f", '{"a": 1}')]),
    (block('{"na\\u006de": "f", "arguments": {"a": 1}}'), None, [("f", '{"a": 1}')]),
    (block('{"name": "a\\"b\\u00e9", "arguments": {}}'), None, [('a"bé', "{}")]),
    (block('{ "name" : "f" , "arguments" :\n{ "a" : 1 } }'), None, [("f", '{ "a" : 1 }')]),
    # whitespace variants
    ("  \n" + block(WEATHER) + "  \n ", None, [WEATHER_CALL]),
    ("Hi\r\n\t" + block(WEATHER) + "\r\n" + block(TIME), "Hi", [WEATHER_CALL, TIME_CALL]),
    (block(WEATHER) + "\n\nDone, see above.\n", "Done, see above.\n", [WEATHER_CALL]),
    ("A\n" + block(WEATHER) + "\nB \n" + block(TIME) + "\n", "AB", [WEATHER_CALL, TIME_CALL]),
    ("\t<tool_call>\t" + WEATHER + "\t</tool_call>\t", None, [WEATHER_CALL]),
    # invalid blocks (known before the name completes) are content, whitespace kept
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("Hi\n" + block("{name: 'f'}") + "\n", "Hi\n" + block("{name: 'f'}") + "\n", []),
    (block('{"name": 42, "arguments": {}}'), block('{"name": 42, "arguments": {}}'), []),
    (block('{"arguments": "x", "name": "f"}'), block('{"arguments": "x", "name": "f"}'), []),
    (block('{"arguments": {}, "arguments": {}, "name": "f"}'),
     block('{"arguments": {}, "arguments": {}, "name": "f"}'), []),
    (block('[{"name": "f", "arguments": {}}]'), block('[{"name": "f", "arguments": {}}]'), []),
    (block('{"arguments": {"a": NaN}, "name": "f"}'),
     block('{"arguments": {"a": NaN}, "name": "f"}'), []),
    ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    (block(WEATHER) + "\n<tool_call>oops</tool_call> end", "<tool_call>oops</tool_call> end",
     [WEATHER_CALL]),
    ("x <tool_call>oops</tool_call>\n" + block(TIME), "x <tool_call>oops</tool_call>", [TIME_CALL]),
    # no closing tag at the end: a complete valid object is a call, anything else content
    ("Sure.\n<tool_call>\n" + WEATHER, "Sure.", [WEATHER_CALL]),
    ("<tool_call>\n" + WEATHER + "\n</tool_", None, [WEATHER_CALL]),
    ("<tool_call>" + WEATHER + "<", None, [WEATHER_CALL]),
    ("Text <tool_call>\n{\"na", "Text <tool_call>\n{\"na", []),
    ("Text\n<tool_call>", "Text\n<tool_call>", []),
    (block(WEATHER) + "\n<tool_call>\n{", "<tool_call>\n{", [WEATHER_CALL]),
    # no tool calls at all
    ("", None, []),
    ("Hello <b>world</b>, 1 < 2.", "Hello <b>world</b>, 1 < 2.", []),
    ("an answer\n\n", "an answer\n\n", []),
    ("<tool_cal> is not a tag <tool", "<tool_cal> is not a tag <tool", []),
    ("</tool_call> stray", "</tool_call> stray", []),
]

# JSON number and literal edge cases, in arguments written before the name
HERMES_CASES += [
    (block(f'{{"arguments": {{"a": {value}}}, "name": "f"}}'), None, [("f", f'{{"a": {value}}}')])
    for value in ("-0", "0.0e-0", "1E+2", "-12.5e10", "true", "false", "null", '"\\/"')
]
HERMES_CASES += [
    (text, text, [])
    for value in ("01", "1.", ".5", "+1", "1e", "-", "--1", "0x1", "tru", "nul1", "Infinity", "'a'")
    for text in [block(f'{{"arguments": {{"a": {value}}}, "name": "f"}}')]
]

# invalid blocks whose name was already streamed:
# (text, extract content, extract calls, stream content, stream calls)
RELAXED_CASES: list[tuple[str, str, Calls, str, Calls]] = [
    (block('{"name": "f", "arguments": {"a": bad}}') + " tail",
     block('{"name": "f", "arguments": {"a": bad}}') + " tail", [], "tail", [("f", '{"a": ')]),
    ('<tool_call>\n{"name": "f", "arguments": {"city": "Par',
     '<tool_call>\n{"name": "f", "arguments": {"city": "Par', [], "", [("f", '{"city": "Par')]),
    (block('{"name": "f", "arguments": {"a": 1}, "name": "g"}'),
     block('{"name": "f", "arguments": {"a": 1}, "name": "g"}'), [], "", [("f", '{"a": 1}')]),
    (block('{"name": "f", "arguments": {}} trailing junk'),
     block('{"name": "f", "arguments": {}} trailing junk'), [], "", [("f", "{}")]),
    (block('{"name": "f", "arguments": [1]}'), block('{"name": "f", "arguments": [1]}'), [],
     "", [("f", "")]),
    ("Hi\n" + block('{"name": "f"') + "\n" + block(TIME), "Hi\n" + block('{"name": "f"'),
     [TIME_CALL], "Hi", [("f", ""), TIME_CALL]),
]

# (text, expected calls): array outputs where stream and extract agree exactly
ARRAY_CASES: list[tuple[str, Calls]] = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
     [("get_weather", '{"city": "Paris"}')]),
    ('[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"s":"}]\\"{["}}]',
     [("a", '{"x":1}'), ("b", '{"s":"}]\\"{["}')]),
    ('\n[\n  {"name": "a", "parameters": {"n": [1, 2.5e-3, true, null]}} ,\n'
     '  {"parameters": {"q": "é"}, "name": "b"}\n]\n',
     [("a", '{"n": [1, 2.5e-3, true, null]}'), ("b", '{"q": "é"}')]),
    ('[{"name": "a", "arguments": {"x": {"y": {}}}}, {"name": "b"}]',
     [("a", '{"x": {"y": {}}}'), ("b", "{}")]),
    ("[]", []),
    (" [ ] ", []),
    ("", []),
    ("Sorry, I cannot.", []),
    ('{"name": "a", "parameters": {}}', []),
    # the list ends at the first element that is not a complete valid call
    ('[{"name": "a", "parameters": {}}, 5, {"name": "b", "parameters": {}}]', [("a", "{}")]),
    ('[{"name": "a", "parameters": {}}, {"name": 5}, {"name": "b"}]', [("a", "{}")]),
    ('[{"name": "a", "parameters": {}}, {"parameters": {}}, {"name": "b"}]', [("a", "{}")]),
    ('[{"name": "a", "parameters": {}}] trailing', [("a", "{}")]),
    ('[{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}]', [("a", "{}")]),
    ('[{"name": "a", "parameters": {"k": "v"}},', [("a", '{"k": "v"}')]),
    ('[{"name": "a", "parameters": {"k": "v"}}, {"name": "b', [("a", '{"k": "v"}')]),
    ('[{"name": "a", "parameters": {"k": "v"}}, {"parameters": {"x": 1}', [("a", '{"k": "v"}')]),
]

# array outputs whose last element was cut after its name: (text, extract, stream)
ARRAY_RELAXED_CASES: list[tuple[str, Calls, Calls]] = [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": ',
     [("a", '{"x": 1}')], [("a", '{"x": 1}'), ("b", '{"y": ')]),
    ('[{"name": "a", "parameters": {"x": 1}}, {"parameters": {"y": 2}, "name": "b"',
     [("a", '{"x": 1}')], [("a", '{"x": 1}'), ("b", '{"y": 2}')]),
    ('[{"name": "a", "parameters": {"x": 1, }}]', [], [("a", '{"x": 1, ')]),
]


def as_pairs(calls: list[ParsedToolCall]) -> Calls:
    return [(call.name, call.arguments) for call in calls]


def assemble(deltas: list[ToolCallDelta]) -> Calls:
    """Join deltas per call, asserting the order rules: indices 0, 1, ... in order, and the
    name exactly on the first delta of each call (so before or with any arguments)."""
    calls: list[list[str]] = []
    for delta in deltas:
        if delta.index == len(calls):
            assert delta.name is not None, delta
            calls.append([delta.name, delta.arguments])
        else:
            assert delta.index == len(calls) - 1, delta
            assert delta.name is None, delta
            assert delta.arguments, delta  # no empty deltas after the first
            calls[-1][1] += delta.arguments
    return [(name, arguments) for name, arguments in calls]


def run_stream(parser: ToolParser, pieces: list[str]) -> tuple[str, Calls]:
    """Feed ``pieces`` through ``parser`` then finish; return (content, calls)."""
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        text, new = parser.stream(piece)
        content.append(text)
        deltas.extend(new)
    text, new = parser.finish()
    content.append(text)
    deltas.extend(new)
    return "".join(content), assemble(deltas)


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    """The whole text, every two-piece split, single characters, and random pieces."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(30 if len(text) > 2 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        yield [text[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


# --- Hermes -------------------------------------------------------------------------------


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_extract(text: str, content: str | None, calls: Calls) -> None:
    got_content, got_calls = HermesToolParser().extract(text)
    assert got_content == content
    assert as_pairs(got_calls) == calls


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_stream_every_split(text: str, content: str | None, calls: Calls) -> None:
    for pieces in splits(text):
        assert run_stream(HermesToolParser(), pieces) == (content or "", calls), pieces


@pytest.mark.parametrize("text,content,calls,streamed_content,streamed_calls", RELAXED_CASES)
def test_hermes_invalid_after_name(
    text: str, content: str, calls: Calls, streamed_content: str, streamed_calls: Calls
) -> None:
    got_content, got_calls = HermesToolParser().extract(text)
    assert (got_content, as_pairs(got_calls)) == (content, calls)
    for pieces in splits(text):
        assert run_stream(HermesToolParser(), pieces) == (streamed_content, streamed_calls), pieces


def test_hermes_valid_call_after_relaxed_block_shifts_index() -> None:
    text = block('{"name": "f", "arguments": {"a": x}}') + "\n" + block(TIME)
    content, calls = HermesToolParser().extract(text)
    assert content == block('{"name": "f", "arguments": {"a": x}}')
    assert as_pairs(calls) == [TIME_CALL]
    parser = HermesToolParser()
    deltas = parser.stream(text)[1] + parser.finish()[1]
    assert deltas == [
        ToolCallDelta(0, "f", '{"a": '),
        ToolCallDelta(1, "get_time", '{"tz": "Europe/Paris"}'),
    ]


def test_hermes_token_stream_exact_deltas() -> None:
    pieces = [
        "Checking", " now.", "\n", "<tool_call>", "\n", '{"name": "', "get", "_weather",
        '", "arguments": {"', "city", '": "', "Par", "is", '"}}', "\n", "</tool_call>", "\n",
        "<tool_", "call>", '{"name": "now"', "}", "</tool_call>",
    ]
    parser = HermesToolParser()
    steps = [parser.stream(piece) for piece in pieces] + [parser.finish()]
    assert steps == [
        ("Checking", []),
        (" now.", []),
        ("", []),  # may be whitespace before a block
        ("", []),
        ("", []),
        ("", []),
        ("", []),
        ("", []),
        ("", [ToolCallDelta(0, "get_weather", '{"')]),
        ("", [ToolCallDelta(0, None, "city")]),
        ("", [ToolCallDelta(0, None, '": "')]),
        ("", [ToolCallDelta(0, None, "Par")]),
        ("", [ToolCallDelta(0, None, "is")]),
        ("", [ToolCallDelta(0, None, '"}')]),  # not the call object's closing brace
        ("", []),
        ("", []),
        ("", []),
        ("", []),
        ("", []),
        ("", [ToolCallDelta(1, "now", "")]),
        ("", []),
        ("", [ToolCallDelta(1, None, "{}")]),  # no arguments key: "{}" when the block ends
        ("", []),
    ]


def test_hermes_arguments_before_name_are_held() -> None:
    parser = HermesToolParser()
    text = '<tool_call>{"arguments": {"a": [1, "}"]}, "name": "f"}</tool_call>'
    deltas = [delta for ch in text for delta in parser.stream(ch)[1]] + parser.finish()[1]
    assert deltas == [ToolCallDelta(0, "f", '{"a": [1, "}"]}')]


def test_hermes_content_is_held_only_while_undecided() -> None:
    parser = HermesToolParser()
    assert parser.stream("a <tool") == ("a", [])
    assert parser.stream("box> b ") == (" <toolbox> b", [])
    assert parser.stream("\n") == ("", [])
    assert parser.finish() == (" \n", [])


def test_hermes_whitespace_before_invalid_block_is_kept() -> None:
    parser = HermesToolParser()
    assert parser.stream("Hi \n<tool_call>") == ("Hi", [])
    assert parser.stream("{oops}") == ("", [])
    assert parser.stream("</tool_call>") == (" \n<tool_call>{oops}</tool_call>", [])
    assert parser.finish() == ("", [])


def test_hermes_unclosed_block_outcomes_at_finish() -> None:
    parser = HermesToolParser()
    assert parser.stream('<tool_call>{"name": "f"}\n</tool') == ("", [ToolCallDelta(0, "f", "")])
    assert parser.finish() == ("", [ToolCallDelta(0, None, "{}")])
    parser = HermesToolParser()
    assert parser.stream('ok <tool_call>{"nam') == ("ok", [])
    assert parser.finish() == (' <tool_call>{"nam', [])


def mutate(text: str, rng: random.Random) -> str:
    """Apply 1 to 3 random edits (delete, insert, duplicate) to ``text``."""
    alphabet = '{}[]":,\\ \n0123456789.eE-+tfnulrsa'
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(text) + 1)
        kind = rng.randrange(3)
        if kind == 0 and i < len(text):
            text = text[:i] + text[i + 1 :]
        elif kind == 1:
            text = text[:i] + rng.choice(alphabet) + text[i:]
        else:
            j = rng.randrange(i, min(len(text), i + 12) + 1)
            text = text[:j] + text[i:j] + text[j:]
    return text


class Pairs(list):
    """A JSON object as its key/value pairs (to see duplicate keys)."""


def reference_call(inner: str) -> tuple[str, object] | None:
    """The documented validity rule, via json.loads: (name, decoded arguments) or None."""

    def reject(name: str) -> None:
        raise ValueError(name)

    try:
        obj = json.loads(inner, object_pairs_hook=Pairs, parse_constant=reject)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, Pairs):
        return None
    names = [value for key, value in obj if key == "name"]
    arguments = [value for key, value in obj if key in ("arguments", "parameters")]
    if len(names) != 1 or len(arguments) > 1 or not isinstance(names[0], str):
        return None
    if arguments and not isinstance(arguments[0], Pairs):
        return None
    return names[0], arguments[0] if arguments else Pairs()


def test_hermes_random_blocks_follow_json_rules() -> None:
    """Mutated blocks: extract agrees with json.loads, the stream with extract (or relaxes)."""
    rng = random.Random(1234)
    seeds = [
        WEATHER,
        f'{{"name": "run", "arguments": {NESTED_ARGS}}}',
        f'{{"arguments": {QUOTES_ARGS}, "name": "say"}}',
        f'{{"name": "u", "parameters": {UNICODE_ARGS}}}',
        '{"name": "f", "arguments": {"t": true, "f": false, "n": null, "x": -1.5E+2}}',
    ]
    valid = relaxed = 0
    for _ in range(1500):
        inner = mutate(rng.choice(seeds), rng)
        text = "Hi\n<tool_call>" + inner + "</tool_call>"
        content, calls = HermesToolParser().extract(text)
        expected = reference_call(inner)
        if expected is None:
            assert (content, calls) == (text, []), inner
        else:
            valid += 1
            assert content == "Hi" and len(calls) == 1, inner
            name, arguments = expected
            assert calls[0].name == name
            assert json.loads(calls[0].arguments, object_pairs_hook=Pairs) == arguments
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(text)])]
        streamed = run_stream(HermesToolParser(), pieces)
        if streamed != (content or "", as_pairs(calls)):
            relaxed += 1
            assert expected is None, inner
            assert streamed[0] == "Hi" and len(streamed[1]) == 1, inner
            assert streamed[1][0][1] in text, inner  # raw text, maybe past the tag in a string
    assert valid > 100 and relaxed > 100  # both kinds were exercised


# --- JSON array ---------------------------------------------------------------------------


@pytest.mark.parametrize("text,calls", ARRAY_CASES)
def test_array_extract(text: str, calls: Calls) -> None:
    content, got = JsonArrayToolParser().extract(text)
    assert content is None
    assert as_pairs(got) == calls


@pytest.mark.parametrize("text,calls", ARRAY_CASES)
def test_array_stream_every_split(text: str, calls: Calls) -> None:
    for pieces in splits(text):
        assert run_stream(JsonArrayToolParser(), pieces) == ("", calls), pieces


@pytest.mark.parametrize("text,extracted,streamed", ARRAY_RELAXED_CASES)
def test_array_cut_after_name(text: str, extracted: Calls, streamed: Calls) -> None:
    assert as_pairs(JsonArrayToolParser().extract(text)[1]) == extracted
    for pieces in splits(text):
        assert run_stream(JsonArrayToolParser(), pieces) == ("", streamed), pieces


def test_array_token_stream_exact_deltas() -> None:
    pieces = ['[{"name": "', "a", '", "parameters": {"x": ', "1", "}}, ", '{"name": "b"}', "]"]
    parser = JsonArrayToolParser()
    steps = [parser.stream(piece) for piece in pieces] + [parser.finish()]
    assert steps == [
        ("", []),
        ("", []),
        ("", [ToolCallDelta(0, "a", '{"x": ')]),
        ("", [ToolCallDelta(0, None, "1")]),
        ("", [ToolCallDelta(0, None, "}")]),
        ("", [ToolCallDelta(1, "b", "{}")]),
        ("", []),
        ("", []),
    ]


# --- Llama 3 JSON, Mistral, Phi-4-mini ----------------------------------------------------

LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (parser, text, content, calls): stream and extract agree exactly on these
NEW_CASES: list[tuple[type[ToolParser], str, str | None, Calls]] = [
    # Llama 3.x: bare JSON calls, maybe after <|python_tag|>, separated by ";"
    (Llama3JsonToolParser, LLAMA_WEATHER, None, [WEATHER_CALL]),
    (Llama3JsonToolParser, "<|python_tag|>" + LLAMA_TIME, None, [TIME_CALL]),
    (Llama3JsonToolParser, " \n<|python_tag|> " + LLAMA_WEATHER + "\n", None, [WEATHER_CALL]),
    (Llama3JsonToolParser, LLAMA_WEATHER + "; " + LLAMA_TIME, None, [WEATHER_CALL, TIME_CALL]),
    (Llama3JsonToolParser, LLAMA_WEATHER + "\n;\n" + LLAMA_TIME + ";" + '{"name": "now", "parameters": {}}',
     None, [WEATHER_CALL, TIME_CALL, ("now", "{}")]),
    (Llama3JsonToolParser, f'{{"parameters": {NESTED_ARGS}, "name": "run"}}', None, [("run", NESTED_ARGS)]),
    (Llama3JsonToolParser, f'{{"name": "say", "parameters": {QUOTES_ARGS}}}', None, [("say", QUOTES_ARGS)]),
    (Llama3JsonToolParser, f'{{"type": "function", "name": "u", "parameters": {UNICODE_ARGS}}}', None,
     [("u", UNICODE_ARGS)]),
    (Llama3JsonToolParser, LLAMA_WEATHER + "\n\nDone, see above.", "Done, see above.", [WEATHER_CALL]),
    (Llama3JsonToolParser, LLAMA_WEATHER + " ; \n", None, [WEATHER_CALL]),  # a trailing ";" is dropped
    (Llama3JsonToolParser, LLAMA_WEATHER + "; oops", "; oops", [WEATHER_CALL]),
    (Llama3JsonToolParser, LLAMA_WEATHER + ';{"name": 5}', ';{"name": 5}', [WEATHER_CALL]),
    (Llama3JsonToolParser, LLAMA_WEATHER + "; {bad} " + LLAMA_TIME, "; {bad} " + LLAMA_TIME, [WEATHER_CALL]),
    # not a call: all content, as written
    (Llama3JsonToolParser, "", None, []),
    (Llama3JsonToolParser, "  \n", "  \n", []),
    (Llama3JsonToolParser, "The weather is nice.", "The weather is nice.", []),
    (Llama3JsonToolParser, "Calling " + LLAMA_WEATHER, "Calling " + LLAMA_WEATHER, []),
    (Llama3JsonToolParser, "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    (Llama3JsonToolParser, "<|python_ta", "<|python_ta", []),
    (Llama3JsonToolParser, " <|python_tag|> ", " <|python_tag|> ", []),
    (Llama3JsonToolParser, '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),  # no arguments
    (Llama3JsonToolParser, '{name: "f"} x', '{name: "f"} x', []),
    (Llama3JsonToolParser, '{"parameters": {"a": 01}, "name": "f"}', '{"parameters": {"a": 01}, "name": "f"}', []),
    (Llama3JsonToolParser, '{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    (Llama3JsonToolParser, '{"name": "f", "par', '{"name": "f", "par', []),
    (Llama3JsonToolParser, "{}; " + LLAMA_WEATHER, "{}; " + LLAMA_WEATHER, []),
    # Mistral: content, then [TOOL_CALLS] and a JSON array (v0.3 / v7) or name[ARGS]{...} (v11+)
    (MistralToolParser, "[TOOL_CALLS][" + WEATHER + "]", None, [WEATHER_CALL]),
    (MistralToolParser, "[TOOL_CALLS] [" + WEATHER + ", " + TIME + "]", None, [WEATHER_CALL, TIME_CALL]),
    (MistralToolParser, "Let me check.\n\n[TOOL_CALLS][" + WEATHER + "]\nDone.", "Let me check.Done.",
     [WEATHER_CALL]),
    (MistralToolParser, '[TOOL_CALLS][{"name": "run", "parameters": ' + NESTED_ARGS + '}, {"name": "now"}]',
     None, [("run", NESTED_ARGS), ("now", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None, [WEATHER_CALL]),
    (MistralToolParser, "Sure [TOOL_CALLS]web[ARGS]" + CLOSE_TAG_ARGS + "[TOOL_CALLS]say[ARGS]" + QUOTES_ARGS,
     "Sure", [("web", CLOSE_TAG_ARGS), ("say", QUOTES_ARGS)]),
    (MistralToolParser, '[TOOL_CALLS]get_time{"tz": "Europe/Paris"} ok', "ok", [TIME_CALL]),
    (MistralToolParser, "[TOOL_CALLS]get_weather(city='Paris')", "[TOOL_CALLS]get_weather(city='Paris')", []),
    (MistralToolParser, '[TOOL_CALLS]ns.f-1[ARGS] {"a": 1}', None, [("ns.f-1", '{"a": 1}')]),
    (MistralToolParser, "[TOOL_CALLS] oops [TOOL_CALLS]now[ARGS]{}", "[TOOL_CALLS] oops", [("now", "{}")]),
    (MistralToolParser, "[TOOL_CALLS][" + WEATHER + ", 5, " + TIME + "] tail", None, [WEATHER_CALL]),
    (MistralToolParser, "[TOOL_CALLS][" + WEATHER + ', {"name": "get_t', None, [WEATHER_CALL]),
    (MistralToolParser, "No tools needed.", "No tools needed.", []),
    (MistralToolParser, "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    (MistralToolParser, "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    (MistralToolParser, "Hi [TOOL_CALL", "Hi [TOOL_CALL", []),
    (MistralToolParser, '[TOOL_CALLS][{"name": 5}]', '[TOOL_CALLS][{"name": 5}]', []),
    (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS][1]", "[TOOL_CALLS]get_weather[ARGS][1]", []),
    (MistralToolParser, "[TOOL_CALLS]get_weather[ARG", "[TOOL_CALLS]get_weather[ARG", []),
    # Phi-4-mini: <|tool_call|>[...]<|/tool_call|> (its tokens) and functools[...] (vLLM's template)
    (Phi4MiniJsonToolParser, "<|tool_call|>[" + WEATHER + "]<|/tool_call|>", None, [WEATHER_CALL]),
    (Phi4MiniJsonToolParser, "I'll check.\n<|tool_call|>[" + WEATHER + ", " + TIME + "]<|/tool_call|>\n",
     "I'll check.", [WEATHER_CALL, TIME_CALL]),
    (Phi4MiniJsonToolParser, "<|tool_call|>[" + WEATHER + "]<|/tool_call|>\n<|tool_call|>[" + TIME
     + "]<|/tool_call|> Done.", "Done.", [WEATHER_CALL, TIME_CALL]),
    (Phi4MiniJsonToolParser, '<|tool_call|>[{"name": "web", "parameters": {"s": "<|/tool_call|>"}}]<|/tool_call|>',
     None, [("web", '{"s": "<|/tool_call|>"}')]),
    (Phi4MiniJsonToolParser, "<|tool_call|> [" + WEATHER + "] <|/tool_", None, [WEATHER_CALL]),
    (Phi4MiniJsonToolParser, "<|tool_call|>[" + WEATHER + ", 7]junk<|/tool_call|>ok", "ok", [WEATHER_CALL]),
    (Phi4MiniJsonToolParser, "functools[" + WEATHER + ", " + TIME + "]", None, [WEATHER_CALL, TIME_CALL]),
    (Phi4MiniJsonToolParser, "Use functools.partial.\nfunctools[" + TIME + "]", "Use functools.partial.",
     [TIME_CALL]),
    (Phi4MiniJsonToolParser, "<|tool_call|>oops<|/tool_call|> x", "<|tool_call|>oops<|/tool_call|> x", []),
    (Phi4MiniJsonToolParser, '<|tool_call|>[{"name": 5}]<|/tool_call|>', '<|tool_call|>[{"name": 5}]<|/tool_call|>',
     []),
    (Phi4MiniJsonToolParser, "<|tool_call|>[]<|/tool_call|>", "<|tool_call|>[]<|/tool_call|>", []),
    (Phi4MiniJsonToolParser, "import functools\n", "import functools\n", []),
    (Phi4MiniJsonToolParser, "Plain <|tool_ca", "Plain <|tool_ca", []),
    # SmolLM2 (the embedded model): a JSON array of calls in <tool_call> tags
    (SmolLM2ToolParser, "<tool_call>[\n" + WEATHER + "\n]</tool_call>", None, [WEATHER_CALL]),
    (SmolLM2ToolParser, "Let me see.\n<tool_call>[" + WEATHER + ",\n" + TIME + "]</tool_call>",
     "Let me see.", [WEATHER_CALL, TIME_CALL]),
    (SmolLM2ToolParser, '<tool_call>[{"name": "web", "parameters": ' + CLOSE_TAG_ARGS + '}]</tool_call> ok',
     "ok", [("web", CLOSE_TAG_ARGS)]),
    (SmolLM2ToolParser, "<tool_call>[" + WEATHER + ", 7]junk</tool_call>", None, [WEATHER_CALL]),
    (SmolLM2ToolParser, "<tool_call>[" + WEATHER, None, [WEATHER_CALL]),  # (out of tokens)
    (SmolLM2ToolParser, block(WEATHER), block(WEATHER), []),  # a Hermes object is not its format
    (SmolLM2ToolParser, "<tool_call>[]</tool_call>", "<tool_call>[]</tool_call>", []),
    (SmolLM2ToolParser, "Paris is the capital of France.", "Paris is the capital of France.", []),
]

# outputs that fail after a name was streamed: (parser, text, extract (content, calls),
# stream (content, calls))
NEW_RELAXED_CASES: list[tuple[type[ToolParser], str, tuple[str | None, Calls], tuple[str, Calls]]] = [
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"a": bad}} tail',
     ('{"name": "f", "parameters": {"a": bad}} tail', []), ("", [("f", '{"a": ')])),
    (Llama3JsonToolParser, LLAMA_WEATHER + '; {"name": "g", "parameters": {"x": 1}',
     ('; {"name": "g", "parameters": {"x": 1}', [WEATHER_CALL]), ("", [WEATHER_CALL, ("g", '{"x": 1}')])),
    (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"a": bad} [TOOL_CALLS]' + "[" + TIME + "]",
     ('[TOOL_CALLS]f[ARGS]{"a": bad}', [TIME_CALL]), ("", [("f", '{"a": ')])),
    (MistralToolParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "name": "g"}]',
     ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "name": "g"}]', []), ("", [("f", '{"a": 1}')])),
    (Phi4MiniJsonToolParser, '<|tool_call|>[{"name": "f", "arguments": {"a": bad}}]<|/tool_call|> tail',
     ('<|tool_call|>[{"name": "f", "arguments": {"a": bad}}]<|/tool_call|> tail', []),
     ("tail", [("f", '{"a": ')])),
]


@pytest.mark.parametrize("parser,text,content,calls", NEW_CASES)
def test_new_parsers_extract(parser: type[ToolParser], text: str, content: str | None, calls: Calls) -> None:
    got_content, got_calls = parser().extract(text)
    assert got_content == content
    assert as_pairs(got_calls) == calls


@pytest.mark.parametrize("parser,text,content,calls", NEW_CASES)
def test_new_parsers_stream_every_split(parser: type[ToolParser], text: str, content: str | None,
                                        calls: Calls) -> None:
    for pieces in splits(text):
        assert run_stream(parser(), pieces) == (content or "", calls), pieces


@pytest.mark.parametrize("parser,text,extracted,streamed", NEW_RELAXED_CASES)
def test_new_parsers_invalid_after_name(parser: type[ToolParser], text: str,
                                        extracted: tuple[str | None, Calls], streamed: tuple[str, Calls]) -> None:
    content, calls = parser().extract(text)
    assert (content, as_pairs(calls)) == extracted
    for pieces in splits(text):
        assert run_stream(parser(), pieces) == streamed, pieces


def test_llama3_token_stream_exact_deltas() -> None:
    pieces = ["<|python_tag|>", '{"name": "', "get", "_time", '", "parameters": {"', "tz", '": "UTC"}}',
              "; ", '{"parameters": {}, ', '"name": "now"}', "\n"]
    parser = Llama3JsonToolParser()
    steps = [parser.stream(piece) for piece in pieces] + [parser.finish()]
    assert steps == [
        ("", []),
        ("", []),
        ("", []),
        ("", []),
        ("", [ToolCallDelta(0, "get_time", '{"')]),  # the name once its arguments start
        ("", [ToolCallDelta(0, None, "tz")]),
        ("", [ToolCallDelta(0, None, '": "UTC"}')]),  # not the call object's closing brace
        ("", []),
        ("", []),
        ("", [ToolCallDelta(1, "now", "{}")]),
        ("", []),
        ("", []),
    ]


def test_mistral_v11_token_stream_exact_deltas() -> None:
    pieces = ["Ok", ".\n", "[TOOL_CALLS]", "get", "_time", "[ARGS]", '{"tz": ', '"UTC"}', "[TOOL_CALLS]",
              "now[ARGS]{}"]
    parser = MistralToolParser()
    steps = [parser.stream(piece) for piece in pieces] + [parser.finish()]
    assert steps == [
        ("Ok", []),
        (".", []),
        ("", []),
        ("", []),
        ("", []),
        ("", []),
        ("", [ToolCallDelta(0, "get_time", '{"tz": ')]),
        ("", [ToolCallDelta(0, None, '"UTC"}')]),
        ("", []),
        ("", [ToolCallDelta(1, "now", "{}")]),
        ("", []),
    ]


@pytest.mark.parametrize("parser,seeds", [
    (Llama3JsonToolParser, [LLAMA_WEATHER, f"<|python_tag|>{LLAMA_WEATHER}; {LLAMA_TIME}",
                            f" {LLAMA_TIME};\n{LLAMA_WEATHER}\nok"]),
    (MistralToolParser, [f"Hi\n[TOOL_CALLS][{WEATHER}, {TIME}]", '[TOOL_CALLS]a[ARGS]{"x": 1} [TOOL_CALLS]b{} end',
                         f"x [TOOL_CALLS] [{TIME}] y [TOOL_CALLS][{WEATHER}]"]),
    (Phi4MiniJsonToolParser, [f"Hi\n<|tool_call|>[{WEATHER}, {TIME}]<|/tool_call|>\nok <|tool_call|>[{TIME}]",
                              f"functools[{WEATHER}, {TIME}] and functools[{TIME}]"]),
    (SmolLM2ToolParser, [f"Hi\n<tool_call>[{WEATHER}, {TIME}]</tool_call>\nok <tool_call>[{TIME}]",
                         f"<tool_call>[\n{WEATHER}\n]</tool_call>"]),
])
def test_new_parsers_random_outputs(parser: type[ToolParser], seeds: list[str]) -> None:
    """Mutated outputs: the stream is the same for every split, and equals extract unless a
    call failed after its name was streamed (see relaxed_shape)."""
    rng = random.Random(4321)
    relaxed = 0
    for _ in range(400):
        text = mutate(rng.choice(seeds), rng)
        content, calls = parser().extract(text)
        expected = (content or "", as_pairs(calls))
        streamed = run_stream(parser(), [text])
        assert run_stream(parser(), list(text)) == streamed, text
        cuts = sorted(rng.sample(range(1, len(text)), 5))
        assert run_stream(parser(), [text[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(text)])]) == streamed
        if streamed != expected:
            relaxed += 1
            assert relaxed_shape(streamed[1], expected[1]), text
    assert 20 < relaxed < 300  # both kinds were exercised


def relaxed_shape(streamed: Calls, expected: Calls) -> bool:
    """The streamed calls are extract's with extra ones (calls that failed after their name)
    among them, and if the stream lacks some of extract's calls, it ends with an extra one
    (a block without an end tag failed: the rest of the output was dropped)."""
    matched, last_extra = 0, False
    for call in streamed:
        last_extra = not (matched < len(expected) and call == expected[matched])
        matched += not last_extra
    return len(streamed) > matched and (matched == len(expected) or last_extra)


# --- registry -------------------------------------------------------------------------------


def test_get_tool_parser() -> None:
    for name in ("hermes", "qwen3", "nanbeige"):
        assert get_tool_parser(name) is HermesToolParser
    for name in ("llama3_json", "llama4_json"):
        assert get_tool_parser(name) is Llama3JsonToolParser
    assert get_tool_parser("mistral") is MistralToolParser
    assert get_tool_parser("phi4_mini_json") is Phi4MiniJsonToolParser
    assert get_tool_parser("smollm2") is SmolLM2ToolParser
    assert set(TOOL_PARSERS) == {"hermes", "qwen3", "nanbeige", "llama3_json", "llama4_json", "mistral",
                                 "phi4_mini_json", "smollm2"}
    with pytest.raises(ValueError, match="unknown tool parser 'llama3'") as info:
        get_tool_parser("llama3")
    assert ("hermes, llama3_json, llama4_json, mistral, nanbeige, phi4_mini_json, qwen3, smollm2"
            in str(info.value))
    assert MistralToolParser.format_tokens == ("[TOOL_CALLS]", "[ARGS]")


def test_base_parser_is_an_interface() -> None:
    parser = ToolParser()
    with pytest.raises(NotImplementedError):
        parser.extract("x")
    with pytest.raises(NotImplementedError):
        parser.stream("x")
    with pytest.raises(NotImplementedError):
        parser.finish()


def test_a_parser_whose_tags_are_special_tokens_keeps_them_in_the_decoded_output(smollm2_dir) -> None:
    """Mistral's `[TOOL_CALLS]` is a special token of its tokenizer: decoding with
    skip_special_tokens would drop it before the parser saw it, so a request with tools and
    "auto" choice decodes with special tokens kept (unless the request says otherwise, as
    vLLM does); Hermes's tags are plain text in SmolLM2's tokenizer, so nothing changes."""
    from transformers import AutoTokenizer

    from pagedserve.server.tools import ToolPlan, tags_are_special_tokens
    from pagedserve.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok = Tokenizer(hf)
    mistral = ToolPlan("auto", [], None, parser_name="mistral")
    assert tags_are_special_tokens(mistral, tok)
    assert "[TOOL_CALLS]" not in tok.decode(tok.encode("[TOOL_CALLS][]", add_special_tokens=False))
    assert not tags_are_special_tokens(ToolPlan("auto", [], None, parser_name="hermes"), tok)
    assert not tags_are_special_tokens(ToolPlan("required", [], None), tok)
    assert not tags_are_special_tokens(None, tok)


def test_the_parser_is_found_from_the_chat_template() -> None:
    """`serve` turns tool_choice "auto" on with the parser of the template's own format."""
    from pagedserve.models.source import embedded_file
    from pagedserve.server.tool_parsers.detect import parser_for_template

    assert parser_for_template(embedded_file("chat_template.jinja")) == "smollm2"
    assert TOOL_PARSERS["smollm2"] is SmolLM2ToolParser
    assert parser_for_template("{{ '<|im_start|>' + message['content'] }}") is None  # SmolLM2's GGUF
    assert parser_for_template(None) is None
    qwen3 = '{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>" }}'
    assert parser_for_template(qwen3) == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' + calls | tojson }}") == "mistral"
    assert parser_for_template("<|tool|>{{ tools }}<|/tool|>... <|tool_call|>") == "phi4_mini_json"
    llama = ('<|start_header_id|>user<|end_header_id|> Respond in the format {"name": function name, '
             '"parameters": dictionary of argument name and its value}.')
    assert parser_for_template(llama) == "llama3_json"
