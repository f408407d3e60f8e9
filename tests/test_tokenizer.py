"""Tokenizer wrapper, chat templates, stand-in tokenizer and the incremental detokenizer."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.tokenizer import PLACEHOLDER, IncrementalDetokenizer, Tokenizer

FFFD = "\ufffd"
CHINESE = "我们今天去公园散步，天气非常好。人工智能正在改变世界，龘靐齉爩。"
EMOJI = "Family 👨‍👩‍👧‍👦, flags 🇯🇵🇺🇸🏴‍☠️, skin tones 👍🏽👋🏿, ❤️‍🔥 and 🧑‍💻!"
MIXED = "Hello 世界! Привет, мир. مرحبا بالعالم こんにちは 한국어 ελληνικά ∑∫√ café naïve 🙂 end"
CODE = (
    'def fib(n: int) -> int:\n    """Doc."""\n    if n < 2:\n        return n\n'
    "\treturn fib(n - 1) + fib(n - 2)  # 🎉\n\n\nprint(f\"{fib(10)=}\")\n"
)
TEXTS = {"chinese": CHINESE, "emoji": EMOJI, "mixed": MIXED, "code": CODE}


@pytest.fixture(scope="module")
def smol(smollm2_dir) -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, ChatML template), from the cached folder."""
    return Tokenizer.from_pretrained(smollm2_dir)


def _metaspace_tokenizer(decoder_kind: str) -> Tokenizer:
    """A small SentencePiece-style tokenizer (Metaspace, BPE with byte fallback), built offline."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The quick brown fox jumps over the lazy dog.", "def main():\n    return 42\n",
              "你好世界，今天天气很好。", "Hello world, hello there! Привет мир."] * 5
    rust = RustTokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rust.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    spec = json.loads(rust.to_str())  # add the 256 <0xNN> byte tokens, as SentencePiece models have
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    rust = RustTokenizer.from_str(json.dumps(spec))
    if decoder_kind == "llama":  # Llama-2 style decoder chain
        rust.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ])
    else:
        rust.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace("▁", prepend_scheme="first")]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Tokenizer(hf)


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def spm(request) -> Tokenizer:
    return _metaspace_tokenizer(request.param)


def _chunks(ids: list[int], rng: random.Random | None):
    """ids one at a time (rng None) or in random chunk sizes 1-7."""
    i = 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, 7)
        yield ids[i:i + n]
        i += n


def _check_stream(tok: Tokenizer, ids: list[int], skip: bool, rng: random.Random | None = None,
                  expected: str | None = None, **kwargs) -> list[str]:
    """Stream ids; assert the deltas add up to the full decode and hold back partial characters."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, **kwargs)
    deltas = [detok.step(chunk) for chunk in _chunks(ids, rng)]
    deltas.append(detok.flush())
    full = tok.decode(ids, skip_special_tokens=skip) if expected is None else expected
    assert "".join(deltas) == full
    assert detok.text == full
    assert detok.num_tokens == len(ids)
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas)
    return deltas


@pytest.mark.parametrize("name", list(TEXTS))
def test_stream_byte_level(smol, name):
    text = TEXTS[name]
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    deltas = _check_stream(smol, ids, skip=True)
    assert "".join(deltas) == text
    rng = random.Random(name)
    for _ in range(5):
        _check_stream(smol, ids, skip=True, rng=rng)
        _check_stream(smol, ids, skip=False, rng=rng)


def test_split_characters_are_held_back(smol):
    ids = smol.encode("👍")
    assert len(ids) > 1 and smol.decode(ids[:1]).endswith(FFFD)  # byte-level BPE splits it
    detok = IncrementalDetokenizer(smol)
    assert [detok.step([i]) for i in ids] == [""] * (len(ids) - 1) + ["👍"]
    # A generation cut in the middle of the character: flush releases the bytes, as decode shows.
    detok = IncrementalDetokenizer(smol)
    assert detok.step(ids[:-1]) == ""
    assert detok.flush() == smol.decode(ids[:-1])


@pytest.mark.parametrize("skip", [True, False])
def test_stream_with_special_tokens(smol, skip):
    im_start, im_end = smol.encode("<|im_start|>"), smol.encode("<|im_end|>")
    assert im_start == [smol.bos_token_id] and im_end == [smol.eos_token_id]
    emoji = smol.encode("🇫🇷")
    ids = (im_start + smol.encode("assistant\n" + CHINESE) + im_end + emoji[:2] + im_end
           + emoji[2:] + smol.encode(CODE) + [0] + smol.encode(EMOJI) + im_end)
    rng = random.Random(1)
    _check_stream(smol, ids, skip=skip)
    for _ in range(5):
        _check_stream(smol, ids, skip=skip, rng=rng)
    assert ("<|im_end|>" in smol.decode(ids, skip_special_tokens=skip)) is not skip


@pytest.mark.parametrize("skip", [True, False])
def test_stream_random_ids(smol, skip):
    """Random ids (invalid byte sequences, specials anywhere) still add up to the full decode."""
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randint(1, 60))]
        _check_stream(smol, ids, skip=skip, rng=rng)


def test_stream_after_prompt(smol, spm):
    prompt = smol.apply_chat_template([{"role": "user", "content": "hi"}])
    gen = smol.encode("Sure 😀 here:\n    x = 1")
    _check_stream(smol, gen, skip=True, prompt_ids=prompt)  # byte-level: same as decode(gen)
    # Metaspace: the first generated token keeps its leading space after a prompt.
    prompt, gen = spm.encode("Hello world"), spm.encode("hello there")
    assert spm.decode(gen) == "hello there"
    expected = spm.decode(prompt + gen)[len(spm.decode(prompt)):]
    assert expected == " hello there"
    _check_stream(spm, gen, skip=True, prompt_ids=prompt, expected=expected)


@pytest.mark.parametrize("name", list(TEXTS))
def test_stream_metaspace(spm, name):
    ids = spm.encode(TEXTS[name])
    assert any(t.startswith("<0x") for t in spm.hf.convert_ids_to_tokens(ids))  # byte fallback
    assert spm.decode(ids) == TEXTS[name]
    rng = random.Random(name)
    bos, eos = spm.bos_token_id, spm.eos_token_id
    for skip in (True, False):
        _check_stream(spm, ids, skip=skip)
        _check_stream(spm, [bos] + ids[:5] + [eos] + ids[5:] + [eos], skip=skip, rng=rng)


def test_stream_metaspace_random_ids(spm):
    """Random ids: leading-space handling of every piece, and invalid byte-fallback runs (which a
    full decode turns into U+FFFD as a whole) still add up to the full decode."""
    rng = random.Random(3)
    for _ in range(40):
        ids = [rng.randrange(spm.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            _check_stream(spm, ids, skip=skip, rng=rng)


def test_byte_fallback_run_is_held_until_closed(spm):
    ids = spm.encode("a 🙂 b")
    first_byte = next(k for k, i in enumerate(ids) if i in spm.byte_fallback_ids)
    assert len(spm.byte_fallback_ids) == 256
    detok = IncrementalDetokenizer(spm)
    deltas = [detok.step([i]) for i in ids]
    assert deltas[first_byte:first_byte + 4] == [""] * 4  # the emoji's four byte tokens
    assert "🙂" in deltas[first_byte + 4]  # released by the next piece
    assert "".join(deltas) == "a 🙂 b"


def test_window_stays_small(smol):
    ids = smol.encode(CHINESE + EMOJI + CODE) * 50
    detok = IncrementalDetokenizer(smol)
    for i in ids:
        detok.step([i])
        assert len(detok._window) <= 8  # cost per step does not grow with the sequence
    assert detok.text + detok.flush() == smol.decode(ids)


def test_encode_decode_and_properties(smol):
    assert smol.encode("Hello") == smol.hf.encode("Hello", add_special_tokens=False)
    assert smol.decode(smol.encode("<|im_start|>Hi"), skip_special_tokens=False) == "<|im_start|>Hi"
    assert smol.decode(smol.encode("<|im_start|>Hi")) == "Hi"
    assert (smol.bos_token_id, smol.eos_token_id, smol.vocab_size) == (1, 2, 49152)
    assert {0, 1, 2} <= set(smol.all_special_ids) and 49151 not in smol.all_special_ids
    assert smol.byte_fallback_ids == frozenset()
    assert not smol.is_stand_in
    assert smol.decode([49152, 5]) == PLACEHOLDER.format(49152) + smol.decode([5])


def test_chat_template_chatml(smol):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = smol.render_chat(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert not smol.render_chat(messages, add_generation_prompt=False).endswith("assistant\n")
    ids = smol.apply_chat_template(messages)
    assert ids == smol.encode(text) and ids[0] == smol.bos_token_id
    assert ids.count(smol.eos_token_id) == 2
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    assert smol.render_chat(parts) == text.replace("Hi!", "Hi\n!")
    with pytest.raises(ValueError, match="text content"):
        smol.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    # Default system prompt when none is given.
    assert smol.render_chat([{"role": "user", "content": "x"}]).startswith("<|im_start|>system\n")


def test_no_chat_template_is_a_clear_error(spm):
    with pytest.raises(ValueError, match="no chat template"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert spm.render_chat([{"role": "user", "content": "hi"}], chat_template=template) == "[user] hi\n"


def test_stand_in(smol):
    tok = Tokenizer.stand_in(smol, 151936, eos_token_id=151645, bos_token_id=None)
    assert tok.is_stand_in and tok.vocab_size == 151936 and tok.eos_token_id == 151645
    assert tok.bos_token_id == smol.bos_token_id and 151645 in tok.all_special_ids
    hello = smol.encode("Hello 世界")
    assert tok.encode("Hello 世界") == hello and tok.decode(hello) == "Hello 世界"
    ids = hello + [120000] + smol.encode(" ok") + [151645]
    assert tok.decode(ids) == "Hello 世界<|id:120000|> ok"
    assert tok.decode(ids, skip_special_tokens=False) == "Hello 世界<|id:120000|> ok<|id:151645|>"
    assert tok.decode([-1, 10**9]) == "<|id:-1|><|id:1000000000|>"  # never raises
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        smol.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="smaller"):
        Tokenizer.stand_in(smol, 1000)


@pytest.mark.parametrize("skip", [True, False])
def test_stand_in_stream(smol, skip):
    tok = Tokenizer.stand_in(smol, 166144, eos_token_id=166101, bos_token_id=166100)
    emoji = smol.encode("🙂")
    ids = ([166100] + smol.encode("Hi 你好") + emoji[:2] + [150000, 49152] + emoji
           + [166101, 60000] + smol.encode(" done") + [166101])
    deltas = _check_stream(tok, ids, skip=skip)
    assert "<|id:150000|><|id:49152|>🙂" in "".join(deltas)
    rng = random.Random(5)
    for _ in range(10):  # random ids over the whole model vocabulary, most unknown to the base
        ids = [rng.randrange(tok.vocab_size) for _ in range(40)] + emoji + [1, 2]
        _check_stream(tok, ids, skip=skip, rng=rng,
                      prompt_ids=[160000] + smol.encode("prompt"))


@pytest.mark.parametrize("kind", ["smol", "llama", "metaspace"])
def test_encode_equals_transformers_encode(smollm2_dir, kind):
    """`Tokenizer.encode` goes through the Rust tokenizer's batch encode (faster, and it lets
    other threads run); its ids are Transformers' `encode`'s, special-token text included."""
    tok = Tokenizer.from_pretrained(smollm2_dir) if kind == "smol" else _metaspace_tokenizer(kind)
    assert tok._raw_encode.__name__ == "fast"
    rng = random.Random(3)
    raw = tok.hf.backend_tokenizer
    texts = list(TEXTS.values()) + [raw.decode([rng.randrange(tok.known_vocab_size) for _ in range(40)],
                                               skip_special_tokens=False) for _ in range(100)]
    for text in texts:
        for add in (False, True):
            assert tok.encode(text, add) == tok.hf.encode(text, add_special_tokens=add), (text, add)


def test_encode_falls_back_to_transformers_where_they_differ(smollm2_dir):
    """A Transformers class that rewrites the text before its Rust tokenizer sees it gives other
    ids than the Rust tokenizer alone: the start-up probe notices and keeps Transformers' encode."""
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def encode(self, text, add_special_tokens=True, **kwargs):
            return super().encode(text.upper(), add_special_tokens=add_special_tokens, **kwargs)

    tok = Tokenizer(Shouting(tokenizer_file=str(smollm2_dir / "tokenizer.json")))
    assert tok._raw_encode.__name__ == "slow"
    assert tok.encode("hello") == tok.hf.encode("HELLO", add_special_tokens=False)


def test_encode_keeps_transformers_where_tokenizer_json_truncates(smollm2_dir):
    """A tokenizer.json may turn on truncation or padding, which Transformers' `encode` turns
    off and the Rust tokenizer alone would apply: such tokenizers keep Transformers' encode."""
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    rust.enable_truncation(8)
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust))
    assert tok._raw_encode.__name__ == "slow"
    text = "one two three four five six seven eight nine ten eleven twelve"
    assert len(tok.encode(text)) > 8 and tok.encode(text) == tok.hf.encode(text, add_special_tokens=False)
