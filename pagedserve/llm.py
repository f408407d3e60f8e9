"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from pagedserve.engine.core import EngineCore, FatalEngineError
from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.output_processor import OutputProcessor, SampleState
from pagedserve.engine_args import engine_args
from pagedserve.lora.request import LoRARequest
from pagedserve.models.generation_defaults import sampling_defaults
from pagedserve.models.source import load_tokenizer
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")

# a text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": text},
# {"prompt_token_ids": ids})
Prompt = str | list[int] | dict[str, Any]


def _prompt_parts(prompt: Prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt, exactly one of them set; a clear error otherwise."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown or len(prompt) != 1:
            raise ValueError(f"a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids', "
                             f"not {sorted(prompt)}")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError("a prompt dict's 'prompt' must be a string")
            return prompt["prompt"], None
        prompt = prompt["prompt_token_ids"]
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise TypeError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids', "
                    f"not {type(prompt).__name__}")


class LLM:
    """An in-process engine for offline batch generation.

    `model` is None (the embedded SmolLM2-135M-Instruct), a preset name, a Hugging Face Hub id
    (`revision`, `download_dir`), a Hugging Face folder or a .gguf file. `generation_config`
    ("auto", "vllm" or a folder) gives `get_default_sampling_params`. `quantization="fp8"`
    quantizes the decoder's weights to FP8 at load; a pre-quantized checkpoint runs its own
    method (`pagedserve/quantization/`). Memory for the KV cache comes from `kv_cache_memory` (bytes)
    or, on a GPU, `gpu_memory_utilization` after profiling a forward pass; `kv_cache_dtype="fp8"`
    (or "fp8_e4m3") stores it as float8 e4m3, twice the tokens in the same memory ("auto": the
    model's dtype). `speculative_config` (vLLM's JSON or a dict, e.g. `{"method": "ngram",
    "num_speculative_tokens": 4}`) turns on speculative decoding. `tensor_parallel_size` splits
    the model across that many worker processes (`engine/tp_executor.py`; `close()` ends them);
    `distributed_executor_backend="mp"` runs even one rank in a worker process of its own.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: the engine's settings, the fields of `EngineArgs` (`engine_args.py`)."""
        args = engine_args(model, **kwargs)
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size!r}: the offline LLM runs "
                             "one engine core; several serve behind one endpoint with `pagedserve "
                             "serve --data-parallel-size N` (or run one LLM per GPU)")
        config, source, model_cfg = args.create_engine_config()
        self._defaults = sampling_defaults(source, args.generation_config)
        self.engine = EngineCore(config, source)
        self.tokenizer = load_tokenizer(source, model_cfg, args.tokenizer)
        self._ids = itertools.count()

    def close(self) -> None:
        """End the engine's worker processes, if it has any (tensor parallelism)."""
        self.engine.executor.close()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (its generation_config.json, as chosen by
        `generation_config`); what `generate` and `chat` use when given none."""
        return SamplingParams(**self._defaults)

    # ---- generation -------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's {"prompt": text} and
        {"prompt_token_ids": ids} dicts); results come in input order. `lora_request`: the
        LoRA adapter every prompt runs under, or one per prompt (None: the base model; the
        LLM needs enable_lora=True)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = [_prompt_parts(p) for p in prompts]  # type: ignore[union-attr]
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompts),
                            "sampling_params")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError("priority must have one entry per prompt")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        if any(x is not None and not isinstance(x, LoRARequest) for x in loras):
            raise TypeError("lora_request takes LoRARequest objects (pagedserve.LoRARequest) or None")
        results: list[RequestOutput] = []
        proc = OutputProcessor(self.tokenizer, stream_text=False)
        children: dict[str, tuple[RequestOutput, int]] = {}
        resolved: dict[int, SamplingParams] = {}  # id of a params object in `params` -> it resolved
        try:
            for (text, ids), p, prio, lora in zip(prompts, params, prios, loras):
                if text is not None:
                    ids = self.tokenizer.encode(text, add_special_tokens=True)
                ro = RequestOutput(str(next(self._ids)), text, ids)
                results.append(ro)
                if id(p) not in resolved:  # (once per params object, however many prompts share it)
                    resolved[id(p)] = p.resolve_bad_words(encode_batch=self.tokenizer.encode_batch)
                p = resolved[id(p)]
                for i in range(p.n):
                    child = p.for_sample(i)
                    rid = f"{ro.request_id}-{i}"
                    self.engine.add_request(EngineRequest(rid, ids, child, priority=prio, lora_request=lora))
                    proc.add(rid, i, ids, child)
                    children[rid] = (ro, i)
            self._run(proc, children, len(results), use_tqdm)
        except BaseException:
            self.engine.abort_requests(list(children))
            raise
        return results

    def _run(self, proc: OutputProcessor, children: dict, num_requests: int, use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_requests, desc="Generating", disable=not use_tqdm or num_requests < 2,
                   dynamic_ncols=True)
        unfinished = {ro.request_id: ro for ro, _ in children.values()}
        samples: dict[str, SampleState] = {}
        while self.engine.has_unfinished_requests():
            updated, to_abort = proc.process(self.engine.step())
            self.engine.abort_requests(to_abort)
            for s in updated:
                samples[s.request_id] = s
                if s.finished:
                    ro, _ = children[s.request_id]
                    if ro.request_id in unfinished and all(
                        samples.get(r) is not None and samples[r].finished
                        for r, (parent, _) in children.items() if parent is ro
                    ):
                        del unfinished[ro.request_id]
                        bar.update(1)
        bar.close()
        if self.engine.fatal_error:  # (a worker process died: this LLM is done)
            self.close()
            raise FatalEngineError(f"{self.engine.fatal_error}; create a new LLM to go on")
        decode = functools.lru_cache(maxsize=None)(
            lambda t: self.tokenizer.decode([t], skip_special_tokens=False))
        for rid, (ro, _) in children.items():
            s = samples.get(rid)
            if s is not None and s.error:
                logger.error("request %s failed: %s", rid, s.error)
            if s is not None:
                ro.outputs.append(s.to_completion(decode))
                ro.num_cached_tokens = s.num_cached_tokens
                ro.prompt_logprobs = ro.prompt_logprobs or s.prompt_logprob_entries(decode)
        for ro, _ in children.values():
            ro.outputs.sort(key=lambda o: o.index)
            ro.finished = all(o.finished for o in ro.outputs)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conv, add_generation_prompt, **(chat_template_kwargs or {}))
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- introspection ----------------------------------------------------------------

    @property
    def kv_cache_manager(self):
        return self.engine.kv

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless every KV block is back in the free pool."""
        self.engine.kv.check_integrity(expect_all_free=True)


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, SamplingParams):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    return values
