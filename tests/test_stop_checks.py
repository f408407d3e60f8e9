"""(CPU) The per-token stop checks cost what they match, not what the request holds: a sampled
token is looked up among the stop_token_ids (a set; it was a scan of the list, and a request
may send tens of thousands), and stop strings are searched only where a match can end (the
new text and the longest stop string's length before it), however long the text so far."""

from __future__ import annotations

import time

from pagedserve.engine.output_processor import OutputProcessor, SampleState
from pagedserve.engine.stopping import check_stop
from pagedserve.sampling_params import SamplingParams


def test_a_token_is_looked_up_among_many_stop_token_ids():
    params = SamplingParams(stop_token_ids=list(range(1_000, 51_000)), max_tokens=100_000)
    assert check_stop(params, 50_999, 1, 10, 100_000, 200_000, ()) == ("stop", 50_999)
    t0 = time.process_time()
    for i in range(20_000):  # (tokens that are not stop ids: a scan would read the whole list)
        assert check_stop(params, 60_000 + i % 7, 1, 10, 100_000, 200_000, ()) is None
    took = time.process_time() - t0
    assert took < 0.5, f"20,000 checks against 50,000 stop ids took {took:.2f} s"  # (the scan: 5-10 s)
    sample = params.for_sample(0)
    assert sample.stop_token_set == frozenset(range(1_000, 51_000))


def test_stop_strings_are_searched_where_a_match_can_end():
    stops = [f"never-there-{i:02d}" for i in range(15)] + ["END"]
    s = SampleState("r", 0, SamplingParams(stop=stops), detok=None)

    def check_cost(text_len: int) -> float:
        s.text, s.finish_reason = "x" * text_len, None
        t0 = time.process_time()
        for _ in range(200):
            assert not OutputProcessor._check_stop_strings(s, text_len - 4)
        return (time.process_time() - t0) / 200

    short, long = min(check_cost(1_000) for _ in range(3)), min(check_cost(2_000_000) for _ in range(3))
    assert long < 20 * short + 20e-6, (short, long)  # (the whole text: 2,000x)
    s.text = "x" * 1_000 + "the END"
    assert OutputProcessor._check_stop_strings(s, 1_000 + 3) and s.text == "x" * 1_000 + "the "
    assert s.stop_reason == "END"
