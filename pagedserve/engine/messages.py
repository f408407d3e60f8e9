"""What crosses the boundary between the front end (HTTP server, `LLM`) and the engine core:
plain dataclasses, no torch, pickled over the ZeroMQ sockets of `engine/core_process.py`.

Requests and results: `EngineRequest` in, `TokenOutput` out, `CoreInfo` once when the core is
ready, `CoreStats` with every batch of outputs. The socket messages wrap them:

    front end -> core: AddRequest, AbortRequests, Shutdown
    core -> front end: Ready, StartFailed, StepOutputs, Rejected

Inside the engine, the executor hands the core each step's `StepResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """A request as handed to the engine core (token ids only)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)


@dataclass
class TokenOutput:
    """New tokens of one request after a step."""

    request_id: str
    new_token_ids: list[int]
    # per new token: (its logprob, its rank, [(token id, logprob) of the top-k]); empty if not
    # requested
    new_logprobs: list[tuple[float, int, list[tuple[int, float]]]]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # With a request's first token only: seconds it waited to be scheduled, and from then
    # to its first token (the prefill, chunks and all).
    queue_s: float | None = None
    prefill_s: float | None = None
    error: str | None = None  # with finish_reason "error": why this request failed
    # the last new token is the EOS or stop_token_ids token that ended the request: it stays in
    # the token ids, but its text is not output (unless include_stop_str_in_output), as in vLLM
    stopped_on_token: bool = False
    # with an error: the request itself is at fault (its constraint does not compile), so the
    # server answers 400 rather than reporting an engine failure
    invalid: bool = False
    # with the first token of a request that asked for prompt logprobs: per prompt token after
    # the first, (its logprob, its rank, [(token id, logprob) of the top-k])
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None


@dataclass
class CoreInfo:
    """Facts the front end needs to validate requests, sent once when the core is ready."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...]
    startup_seconds: float


@dataclass
class CoreStats:
    """The core's state after a step (for /metrics and the periodic log line)."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    prefix_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_hits: int
    num_preemptions: int
    prompt_tokens_computed: int  # cumulative prefill tokens actually computed
    generation_tokens: int  # cumulative sampled tokens
    failed_steps: int = 0  # cumulative steps that raised
    failed_requests: int = 0  # cumulative requests failed inside the engine
    # speculative decoding (cumulative): a request's steps that carried drafts, the draft
    # tokens verified, those the target model kept
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # KV tiers (cumulative; engine/kv_tiers.py): prompt blocks found in host memory and on disk
    # after a GPU-cache miss, those looked up there and not found, blocks offloaded to host
    # memory, and the bytes and seconds of the copies (host: both ways; disk: writes + reads)
    kv_host_hits: int = 0
    kv_disk_hits: int = 0
    kv_tier_misses: int = 0
    kv_offloads: int = 0
    kv_host_bytes: int = 0
    kv_host_seconds: float = 0.0
    kv_disk_bytes: int = 0
    kv_disk_seconds: float = 0.0


# ---- socket messages ----------------------------------------------------------------------


@dataclass
class AddRequest:
    """Requests for the core, in order: the samples of one HTTP request (and of any others
    sent in the same turn of the front end's event loop) travel together, so that what they
    share (one prompt's ids, one bad-words list) is pickled once, whatever `n` is."""

    requests: list[EngineRequest]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    info: CoreInfo


@dataclass
class StartFailed:
    traceback: str
    reason: str | None = None  # one line for the user when the settings are at fault (ValueError)


@dataclass
class StepOutputs:
    """One step's outputs (failed requests among them, with finish_reason "error")."""

    outputs: list[TokenOutput]
    stats: CoreStats


@dataclass
class Rejected:
    """The core refused a request (it can never run); `message` says why."""

    request_id: str
    message: str


# ---- worker -> engine core (engine/executor.py) ----

@dataclass
class StepResult:
    """A step's results from the executor: the new tokens (and optional logprobs) of the
    requests that sampled."""

    token_ids: dict[str, list[int]]  # request id -> its new tokens this step (in order)
    # request id -> per new token: (its logprob, its rank, [(token id, logprob) of the top-k])
    logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]]
    # requests whose logits held a NaN or an Inf (not in token_ids: their token is garbage)
    non_finite: list[str] = field(default_factory=list)
    # request id -> why its part of the step failed (e.g. its grammar refused the token)
    failed: dict[str, str] = field(default_factory=dict)
    # requests whose grammar is complete with this step's token (they stop: nothing may follow)
    grammar_done: list[str] = field(default_factory=list)
    # request id -> (the prompt token its first entry scores, per prompt token: (its logprob,
    # its rank, top-k)) for the prefill chunks that asked (engine/prompt_logprobs.py)
    prompt_logprobs: dict[str, tuple[int, list[tuple[float, int, list[tuple[int, float]]]]]] = (
        field(default_factory=dict))
    # with KV tiers: the worker's report since the last step (kv_tiers.TierReport)
    kv_tiers: Any = None
