"""Speculative decoding (`--speculative-config`): the n-gram prompt-lookup proposer
(`ngram.py`, torch-free), its configuration (`config.py`), and the verify pass's sampling
(`rejection.py`: the rejection sampler that keeps the target model's distribution;
`verify.py`: the target distributions of a step's draft positions).
"""
