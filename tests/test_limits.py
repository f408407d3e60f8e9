"""The shared prompt rule (engine/limits.py) that the server, the core and the baseline use."""

from __future__ import annotations

import pytest

from pagedserve.engine.limits import PromptError, check_prompt


def test_output_limit_is_max_tokens_or_the_room_left():
    assert check_prompt([1, 2, 3], 5, max_model_len=10, vocab_size=50) == 5
    assert check_prompt([1, 2, 3], None, max_model_len=10, vocab_size=50) == 7
    assert check_prompt([1, 2, 3], 7, max_model_len=10, vocab_size=50) == 7  # exactly full


@pytest.mark.parametrize("ids, max_tokens, match, param, code", [
    ([], 1, "empty", None, None),
    ([1, 50], 1, r"out of range \[0, 50\): \[50\]", None, None),
    ([-1], 1, "out of range", None, None),
    ([1] * 10, None, "max_model_len", None, "context_length_exceeded"),
    ([1] * 4, 7, "maximum context length is 10 tokens", "max_tokens", "context_length_exceeded"),
])
def test_bad_prompts_name_the_problem(ids, max_tokens, match, param, code):
    with pytest.raises(PromptError, match=match) as e:
        check_prompt(ids, max_tokens, max_model_len=10, vocab_size=50)
    assert (e.value.param, e.value.code) == (param, code)
    assert isinstance(e.value, ValueError)  # (the offline API raises ValueError)


def test_logit_bias_and_allowed_token_ids_must_lie_in_the_vocabulary():
    from pagedserve import SamplingParams
    from pagedserve.engine.limits import check_token_ids

    check_token_ids(SamplingParams(), 10)
    check_token_ids(SamplingParams(logit_bias={0: 1.0, 9: -100.0}, allowed_token_ids=[0, 9]), 10)
    with pytest.raises(PromptError, match=r"logit_bias token ids out of range \[0, 10\): \[10, 12\]") as e:
        check_token_ids(SamplingParams(logit_bias={12: 1.0, 3: 1.0, 10: 1.0}), 10)
    assert e.value.param == "logit_bias"
    with pytest.raises(PromptError, match=r"allowed_token_ids token ids out of range \[0, 10\): \[11\]") as e:
        check_token_ids(SamplingParams(allowed_token_ids=[3, 11]), 10)
    assert e.value.param == "allowed_token_ids"
    for bad in ([], [-1], "12", [1.5]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(allowed_token_ids=[3, 1, 3]).allowed_token_ids == [3, 1]
