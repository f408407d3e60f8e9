"""Speculative decoding's building blocks (issue 27): the n-gram prompt-lookup proposer
(`ngram.py`, torch-free) and the rejection sampler that keeps the target model's
distribution (`rejection.py`). Not wired into the engine yet: no flag turns them on.
"""
