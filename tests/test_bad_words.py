"""(CPU) vLLM's bad_words: the matcher's bitmask rows (one-token words always banned, a longer
word's last token only after its other tokens), its batch calls beside a grammar, the
tokenization into sequences, validation, and the engine: the embedded SmolLM2's greedy output
avoids a banned word, others in the batch are untouched, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.backend import GrammarMatcher, accept_tokens, fill_bitmasks
from pagedserve.structured.bad_words import BadWordsMatcher
from pagedserve.structured.params import StructuredOutputsParams

VOCAB = 70  # three int32 words


def _allowed(mask: torch.Tensor, row: int) -> set[int]:
    words = mask[row].tolist()
    return {t for t in range(VOCAB) if (words[t // 32] >> (t % 32)) & 1}


class OddOnly(GrammarMatcher):
    """A grammar that allows odd tokens only, and refuses even ones."""

    def __init__(self):
        self.taken: list[int] = []

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in range(1, VOCAB, 2):
            word, bit = divmod(t, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)

    def accept_token(self, token_id):
        if token_id % 2 == 0:
            return False
        self.taken.append(token_id)
        return True

    def is_terminated(self):
        return len(self.taken) >= 3

    def rollback(self, num_tokens):
        del self.taken[-num_tokens:]


def test_one_token_words_are_always_banned_longer_ones_after_their_prefix():
    m = BadWordsMatcher([[5], [10, 11, 12], [63]])
    mask = torch.zeros(2, 3, dtype=torch.int32)
    m.fill_bitmask(mask, 1)
    assert _allowed(mask, 1) == set(range(VOCAB)) - {5, 63}  # (63: bit 31 of a word)
    assert (mask[0] == 0).all()  # other rows untouched
    for t in (10, 11):
        assert m.accept_token(t)
    m.fill_bitmask(mask, 0)
    assert _allowed(mask, 0) == set(range(VOCAB)) - {5, 63, 12}
    m.rollback(1)  # back to [10]: 12 allowed again
    m.fill_bitmask(mask, 0)
    assert 12 in _allowed(mask, 0) and 11 in _allowed(mask, 0)
    assert not m.is_terminated()


def test_a_grammar_inside_keeps_its_decisions():
    m = BadWordsMatcher([[3], [7, 9]], OddOnly())
    mask = torch.zeros(1, 3, dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    assert _allowed(mask, 0) == set(range(1, VOCAB, 2)) - {3}
    assert not m.accept_token(4)  # the grammar refuses it, and it is not taken
    assert m.accept_token(7) and m.output == [7] and m.inner.taken == [7]
    m.fill_bitmask(mask, 0)
    assert _allowed(mask, 0) == set(range(1, VOCAB, 2)) - {3, 9}
    m.accept_token(1), m.accept_token(1)
    assert m.is_terminated()  # the grammar's


def test_batch_calls_over_mixed_kinds_of_matchers():
    plain, wrapped, grammar = BadWordsMatcher([[2]]), BadWordsMatcher([[1]], OddOnly()), OddOnly()
    mask = torch.zeros(3, 3, dtype=torch.int32)
    fill_bitmasks([plain, wrapped, grammar], mask, [2, 0, 1])
    assert _allowed(mask, 2) == set(range(VOCAB)) - {2}
    assert _allowed(mask, 0) == set(range(3, VOCAB, 2))
    assert _allowed(mask, 1) == set(range(1, VOCAB, 2))
    assert accept_tokens([plain, wrapped, grammar], [4, 6, 5]) == [True, False, True]
    assert plain.output == [4] and wrapped.output == [] and grammar.taken == [5]


def test_resolve_bad_words_takes_the_word_as_written_and_after_a_space():
    vocab = {"hat": [1], " hat": [2], "red hat": [3, 1], " red hat": [4, 2], "same": [9], " same": [9]}
    p = SamplingParams(bad_words=["hat", " red hat", "same"]).resolve_bad_words(lambda t: vocab[t])
    assert p.bad_words_token_ids == [[1], [2], [3, 1], [4, 2], [9]]
    free = SamplingParams()
    assert free.resolve_bad_words(lambda t: 1 / 0) is free  # (nothing to tokenize)


@pytest.mark.parametrize("kw", [{"bad_words": "hat"}, {"bad_words": ["ok", ""]}, {"bad_words": [" "]},
                                {"bad_words_token_ids": [[]]}, {"bad_words_token_ids": [[1, -2]]}])
def test_invalid_bad_words_name_the_field(kw):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(**kw)


def test_bad_words_with_a_grammar_after_reasoning_is_refused():
    so = StructuredOutputsParams(regex="[a-z]+", after_tokens=(5,))
    with pytest.raises(ValueError, match="bad_words cannot be combined"):
        SamplingParams(bad_words=["hat"], structured_outputs=so)
    SamplingParams(bad_words=["hat"], structured_outputs=StructuredOutputsParams(regex="[a-z]+"))


@pytest.fixture(scope="module")
def llm():
    from pagedserve import LLM

    return LLM(max_model_len=512, max_num_seqs=4)


def test_engine_avoids_banned_words_and_leaves_others_alone(llm):
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    free = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    # a one-token word: the greedy first token
    first = tok.decode([free[0]]).strip()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                bad_words=[first]), use_tqdm=False)[0].outputs[0]
    assert first not in out.text and out.token_ids[0] != free[0]
    # a two-token word from later in the free output: the output is the same up to its first
    # token, then takes another
    k = next(i for i in range(2, len(free) - 1)
             if tok.encode(tok.decode(free[i:i + 2]), add_special_tokens=False) == free[i:i + 2])
    word = tok.decode(free[k:k + 2])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word])
    both = llm.generate([prompt, "Once upon a time"], [params, greedy], use_tqdm=False)
    got = both[0].outputs[0].token_ids
    assert got[:k + 1] == free[:k + 1] and got[k + 1] != free[k + 1]
    assert all(got[i:i + 2] != free[k:k + 2] for i in range(len(got) - 1))
    alone = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert both[1].outputs[0].token_ids == alone  # the unconstrained request is untouched
    llm.check_no_leaks()


def test_engine_refuses_untokenized_bad_words(llm):
    from pagedserve.engine.limits import PromptError
    from pagedserve.engine.messages import EngineRequest

    with pytest.raises(PromptError, match="bad_words were not tokenized"):
        llm.engine.add_request(EngineRequest("raw", [1, 2, 3], SamplingParams(bad_words=["hat"])))
