"""Tokenizer, chat templates and streaming detokenization.

`Tokenizer` is a thin wrapper over a Transformers tokenizer: it adds chat-template helpers and one
rule Transformers lacks: ids outside the tokenizer's vocabulary decode to a visible placeholder
(`<|id:N|>`) instead of vanishing. That rule is what makes `Tokenizer.stand_in` work: the presets
that run with dummy weights have no tokenizer files, so they borrow the embedded model's
(SmolLM2's) tokenizer, and every id it does not know renders as a placeholder.

`IncrementalDetokenizer` turns a growing list of generated ids into text deltas for streaming.

Why not `tokenizers.decoders.DecodeStream` (evaluated with tokenizers 0.23)? Its core idea is the
one used here (decode a short window of ids, emit the growth once it no longer ends in U+FFFD), and
it handles `skip_special_tokens` and a prompt prefix (`DecodeStream(ids=prompt)`) correctly. But:
(1) it has no flush, so a generation cut inside a character never emits its last bytes; (2) it
drops ids outside the vocabulary, losing the stand-in placeholders; (3) with SentencePiece byte
fallback it emits a run of byte tokens eagerly and then raises "Invalid prefix encountered" when a
later invalid byte turns the whole run into U+FFFD (257 of 300 random id sequences); (4) its window
is private, so none of this can be fixed around it. The window logic is short, so it lives here, on
top of the same Rust `decode` that Transformers calls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any

PLACEHOLDER = "<|id:{}|>"
"""How an id outside the tokenizer's vocabulary is rendered (e.g. `<|id:151645|>`)."""

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete character


def _content_text(content: Any) -> str:
    """Message content as one string: a string, None, or a list of OpenAI text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts are supported, got {kind or type(part)!r}")
        texts.append(part["text"])
    return "\n".join(texts)


class Tokenizer:
    """A Transformers tokenizer plus chat templates and placeholder rendering of unknown ids.

    Ids are never counted from text: `vocab_size` is the size of the id space the model may emit,
    and decoding any id in it (or outside it) never raises.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        model_vocab_size: int | None = None,
        eos_token_id: int | None = None,
        bos_token_id: int | None = None,
    ) -> None:
        """Wrap an already-built Transformers tokenizer.

        `model_vocab_size` (default: the tokenizer's own size) is reported as `vocab_size`;
        `eos_token_id`/`bos_token_id` override the tokenizer's. An overriding id the tokenizer does
        not know counts as a special token: skipped when decoding with `skip_special_tokens`.
        """
        self.hf = hf_tokenizer
        self.known_vocab_size = len(hf_tokenizer)  # ids below this decode through the tokenizer
        self._vocab_size = model_vocab_size or self.known_vocab_size
        self._eos = hf_tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self._bos = hf_tokenizer.bos_token_id if bos_token_id is None else bos_token_id
        self._extra_special = {
            i for i in (eos_token_id, bos_token_id)
            if i is not None and not 0 <= i < self.known_vocab_size
        }
        self.special_ids = frozenset(  # the ids `skip_special_tokens` removes before decoding
            i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special
        ) | self._extra_special
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        lookup = backend.token_to_id if backend is not None else hf_tokenizer.get_vocab().get
        self.byte_fallback_ids = frozenset(  # SentencePiece-style <0xNN> byte tokens, if any
            i for b in range(256) if (i := lookup(f"<0x{b:02X}>")) is not None
        )
        if backend is not None:  # Rust decode: what Transformers calls, minus per-call overhead
            self._raw_decode = backend.decode
        else:
            def _slow(ids: list[int], skip_special_tokens: bool) -> str:
                return hf_tokenizer.decode(
                    ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
                )
            self._raw_decode = _slow
        self._raw_encode = self._fast_encoder(hf_tokenizer, backend)

    @staticmethod
    def _fast_encoder(hf_tokenizer: Any, backend: Any) -> Any:
        """`(text, add_special_tokens) -> ids` through the Rust tokenizer's `encode_batch_fast`
        (no character offsets: about 25% less time than Transformers' `encode` on a 1,024-token
        prompt; like it, it releases the GIL while it works), or Transformers' `encode` where
        there is no Rust tokenizer, where its tokenizer.json turns on truncation or padding
        (Transformers turns them off for `encode`), or where the two disagree on any of a few
        probe texts (a Transformers class that changes the text before its Rust tokenizer sees
        it)."""
        def slow(text: str, add_special_tokens: bool) -> list[int]:
            return hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

        batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
        if batch is None or backend.truncation is not None or backend.padding is not None:
            return slow

        def fast(text: str, add_special_tokens: bool) -> list[int]:
            return batch([text], add_special_tokens=add_special_tokens)[0].ids

        special = [t for t in (hf_tokenizer.bos_token, hf_tokenizer.eos_token) if isinstance(t, str)]
        probes = ["Hello world", " leading space", "two  spaces\nnew line\t tab", "héllo 日本語 🌍",
                  "".join(special) + " between " + "".join(reversed(special)), ""]
        if all(fast(t, a) == slow(t, a) for t in probes for a in (False, True)):
            return fast
        return slow

    @classmethod
    def from_pretrained(cls, path: str | PathLike[str], **kwargs: Any) -> Tokenizer:
        """Load the tokenizer files of a model folder (kwargs go to Transformers).

        A folder with `tokenizer.json` loads through `PreTrainedTokenizerFast`, which imports
        no torch (`AutoTokenizer` imports the model stack, and torch with it): the HTTP process
        stays free of torch. Other folders (vocabulary files only) go through `AutoTokenizer`.
        """
        if (Path(path) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return cls(PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs))
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), **kwargs))

    @classmethod
    def stand_in(
        cls,
        base: Tokenizer,
        model_vocab_size: int,
        *,
        eos_token_id: int | None = None,
        bos_token_id: int | None = None,
    ) -> Tokenizer:
        """A tokenizer for a model that ships none (dummy-weight presets).

        Text is encoded with `base` (normally SmolLM2's tokenizer; its ids are valid for the
        model because `model_vocab_size` must be at least the base vocabulary) and the base chat
        template is used. When decoding, ids the base knows decode normally and every other id in
        the model's vocabulary renders as `<|id:N|>`, so random tokens from dummy weights stream as
        visible text. Pass the model's `eos_token_id`/`bos_token_id` so stop checks use its ids.
        """
        if model_vocab_size < base.known_vocab_size:
            raise ValueError(
                f"stand-in tokenizer: the model vocabulary ({model_vocab_size}) is smaller than "
                f"the base tokenizer's ({base.known_vocab_size}); encoded ids would be invalid"
            )
        return cls(base.hf, model_vocab_size=model_vocab_size, eos_token_id=eos_token_id,
                   bos_token_id=bos_token_id)

    # ---- properties -------------------------------------------------------------------------

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def vocab_size(self) -> int:
        """Size of the id space (the model's vocabulary for a stand-in, else `len(tokenizer)`)."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """Every id that decoding with `skip_special_tokens` drops (all special added tokens)."""
        return sorted(self.special_ids)

    @property
    def is_stand_in(self) -> bool:
        return self._vocab_size != self.known_vocab_size or bool(self._extra_special)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers: the longest token
        string in UTF-8 (a byte-level BPE symbol stands for one byte but takes one or two; a
        SentencePiece "▁" stands for a one-byte space; "<0xNN>" for one byte). A text of B bytes
        is therefore at least B / max_token_bytes tokens, before any normalization."""
        tokens = self.hf.convert_ids_to_tokens(list(range(self.known_vocab_size)))
        return max((len(t.encode("utf-8", "surrogatepass")) for t in tokens if t), default=1)

    # ---- encode / decode --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (no BOS/EOS added unless `add_special_tokens`): Transformers'
        `encode`'s, through the Rust tokenizer where it gives the same (`_fast_encoder`)."""
        return self._raw_encode(text, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of each text, in one call to the Rust tokenizer where `encode` uses it
        (one crossing for thousands of short texts, GIL released; else one `encode` each)."""
        if self._raw_encode.__name__ != "fast":
            return [self._raw_encode(t, add_special_tokens) for t in texts]
        backend = self.hf.backend_tokenizer
        batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        return [e.ids for e in batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Unknown ids render as placeholders; the ids between them decode as runs."""
        ids = list(ids)
        if not ids or (min(ids) >= 0 and max(ids) < self.known_vocab_size):
            return self._raw_decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for i in ids:
            if 0 <= i < self.known_vocab_size:
                run.append(i)
                continue
            if run:
                parts.append(self._raw_decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            parts.append(self.unknown_text(i, skip_special_tokens))
        if run:
            parts.append(self._raw_decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def unknown_text(self, token_id: int, skip_special_tokens: bool) -> str:
        """Text of one id outside the tokenizer's vocabulary."""
        if skip_special_tokens and token_id in self._extra_special:
            return ""
        return PLACEHOLDER.format(token_id)

    # ---- chat -------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The source of the model's own chat template (named templates joined), if any."""
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(str(t) for t in template.values())
        return template if isinstance(template, str) else None

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs
    ) -> str:
        """The prompt text for `messages` from the model's own chat template.

        Content may be a string or a list of OpenAI `{"type": "text", "text": ...}` parts (joined
        with newlines). `template_kwargs` reach the template (e.g. `tools`, `enable_thinking`) or
        Transformers (`chat_template=` to supply one). Raises ValueError without a template.
        """
        if not getattr(self.hf, "chat_template", None) and "chat_template" not in template_kwargs:
            raise ValueError(
                "this model's tokenizer has no chat template; send a plain completion prompt "
                "or pass chat_template="
            )
        messages = [{**m, "content": _content_text(m.get("content"))} for m in messages]
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs
    ) -> list[int]:
        """Prompt ids for `messages` (see `render_chat`); the template supplies special tokens."""
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Streams the text of one request's generated ids, a delta per `step`.

    Invariant: after `flush()`, the concatenated deltas equal
    `tokenizer.decode(generated_ids, skip_special_tokens)` when no `prompt_ids` were given. A delta
    never ends in a partial character: ids are held back while their text ends in U+FFFD (a
    character split across byte tokens), or while they end in a run of SentencePiece byte-fallback
    tokens, and released when the character completes (or the run ends), or by `flush()`.

    With `prompt_ids`, the last few prompt ids are decoding context and the deltas are the
    continuation of the prompt text: `decode(tail + generated)` minus `decode(tail)`. For
    byte-level BPE that equals `decode(generated)`; for SentencePiece/Metaspace tokenizers it keeps
    the first generated token's leading space, which a standalone decode strips.

    Cost per step is a decode of a short window (the ids since the last emission plus one emitted
    chunk), independent of the sequence length.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
        context_tokens: int = 5,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._chunks: list[str] = []  # emitted deltas; joined lazily (no O(n) copy per step)
        self._num_tokens = 0
        # Window of ids; [0, _read) decoded to _prefix_text (already emitted), [_read:] pending.
        self._window: list[int] = []
        self._read = 0
        self._prefix_text = ""
        if prompt_ids and context_tokens > 0:
            known = tokenizer.known_vocab_size
            tail: list[int] = []
            for i in reversed(prompt_ids):  # stop at an unknown id: it separates decode runs
                if not 0 <= i < known or len(tail) == context_tokens:
                    break
                tail.append(i)
            tail.reverse()
            while tail and tail[0] in tokenizer.byte_fallback_ids:  # don't start mid byte run
                tail.pop(0)
            prefix = self._decode(tail)
            if not prefix.endswith(_REPLACEMENT):  # a prompt ending mid-character: no context
                self._window, self._read, self._prefix_text = tail, len(tail), prefix

    @property
    def text(self) -> str:
        """All text emitted so far (for stop-string checks)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_tokens(self) -> int:
        """Generated ids received so far."""
        return self._num_tokens

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (possibly empty)."""
        self._num_tokens += len(new_token_ids)
        known = self.tokenizer.known_vocab_size
        deltas = []
        start = 0
        for pos, tid in enumerate(new_token_ids):
            if 0 <= tid < known:
                continue
            # An unknown id ends a decode run (as in Tokenizer.decode): emit all pending text.
            self._window.extend(new_token_ids[start:pos])
            deltas.append(self._emit(force=True))
            deltas.append(self.tokenizer.unknown_text(tid, self.skip_special_tokens))
            self._window, self._read, self._prefix_text = [], 0, ""
            start = pos + 1
        if start < len(new_token_ids):
            self._window.extend(new_token_ids[start:])
            deltas.append(self._emit(force=False))
        delta = "".join(deltas)
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emit held-back text (an incomplete trailing character decodes as U+FFFD). Call at end."""
        delta = self._emit(force=True)
        if delta:
            self._chunks.append(delta)
        return delta

    def _in_byte_run(self) -> bool:
        """Whether the ids end inside a run of byte-fallback tokens (skipped specials ignored).

        SentencePiece's byte-fallback decoder turns a whole run of byte tokens into U+FFFD when any
        part of it is invalid UTF-8, so a run's text is final only once a non-byte token ends it.
        """
        byte_ids = self.tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        skipped = self.tokenizer.special_ids if self.skip_special_tokens else frozenset()
        for i in reversed(self._window):
            if i not in skipped:
                return i in byte_ids
        return False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer._raw_decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, force: bool) -> str:
        """Text of the pending ids, or "" while it would end in a partial character."""
        if self._read == len(self._window):
            return ""
        full = self._decode(self._window)
        if not force and (
            len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT) or self._in_byte_run()
        ):
            return ""
        delta = full[len(self._prefix_text):]
        # Slide: the chunk just emitted becomes the context that the next decode starts from.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta
