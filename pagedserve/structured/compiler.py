"""Grammar compilation off the engine loop (torch-free here; the backend may import torch).

The engine core submits each constrained request's `StructuredOutputsParams` when the request
arrives; compilation runs on worker threads, so the loop keeps stepping the other requests,
and the scheduler admits the request once its grammar is ready. Compiled grammars are cached
by constraint (LRU), so the same schema compiles once. A worker takes each new request's
grammar from a compiler by its constraint (`get`): an in-process worker shares the core's,
where it is ready; a tensor-parallel rank compiles its own (the same grammar: compiling is
deterministic), so only the constraint crosses processes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from pagedserve.structured.backend import Grammar, StructuredBackend
from pagedserve.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.config import ModelConfig
    from pagedserve.models.source import ModelSource


class GrammarCompiler:
    """`make_backend()` builds the backend (loading the tokenizer: seconds) on first use, on a
    compile thread."""

    def __init__(self, make_backend: Callable[[], StructuredBackend], max_cached: int = 256,
                 threads: int = 2) -> None:
        self._make_backend = make_backend
        self._backend: StructuredBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        self._max_cached = max_cached

    def submit(self, spec: StructuredOutputsParams) -> Future[Grammar]:
        """The compiled grammar of `spec`, now or later; a failed compile's future holds a
        GrammarError (or the backend's own failure)."""
        key = spec.key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, spec)
        self._cache[key] = future
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return future

    @classmethod
    def for_model(cls, source: ModelSource, model_config: ModelConfig,
                  tokenizer: str | None = None) -> GrammarCompiler:
        """The xgrammar compiler of a model's tokenizer (`tokenizer`: a path to another one),
        its vocabulary as wide as the model's logits, its EOS ids ending a complete grammar."""

        def make_backend() -> StructuredBackend:
            from pagedserve.models.source import load_tokenizer
            from pagedserve.structured.xgrammar_backend import XGrammarBackend

            hf = load_tokenizer(source, model_config, tokenizer).hf
            return XGrammarBackend(hf, model_config.vocab_size, model_config.eos_token_ids)

        return cls(make_backend)

    def get(self, spec: StructuredOutputsParams) -> Grammar:
        """The compiled grammar of `spec`, waiting for it (at once where it was compiled
        already); raises what compiling it raised."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputsParams) -> Grammar:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
        return self._backend.compile(spec)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
