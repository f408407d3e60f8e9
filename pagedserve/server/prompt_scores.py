"""A sample's prompt logprobs in the shapes the endpoints return: vLLM's `prompt_logprobs`
(per prompt token, {token id: {logprob, rank, decoded_token}}) and the entries of the legacy
completions logprobs that `echo` prepends. The engine scores the top k its request asked for
(`SamplingParams.prompt_logprobs`, the most any field asks); each shape takes the top k of
its own field."""

from __future__ import annotations

from pagedserve.engine.output_processor import SampleState


def _top(s: SampleState, j: int, k: int) -> list[tuple[int, float, int]]:
    """(token id, logprob, rank) of prompt token j's top k (likeliest first), then the prompt
    token itself if it is not among them."""
    entry, token = s.prompt_logprobs[j], s.prompt_ids[j]  # type: ignore[index]
    # the engine's entry: its top prompt_logprobs first, likeliest first, then the token if absent
    top = list(entry.items())[: s.params.prompt_logprobs][:k]  # type: ignore[union-attr]
    out = [(t, lp, rank) for rank, (t, lp) in enumerate(top, 1)]
    if all(t != token for t, _ in top):
        out.append((token, entry[token], s.prompt_ranks[j]))  # type: ignore[index]
    return out


def vllm_prompt_logprobs(tokenizer, s: SampleState, k: int) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs` of a sample: None for the first prompt token (nothing precedes
    it), then {token id (a string, as JSON keys are): {"logprob", "rank", "decoded_token"}}.
    None when the sample ended before its prompt was scored (it failed)."""
    if s.prompt_logprobs is None:
        return None
    out: list[dict[str, dict] | None] = [None]
    for j in range(1, len(s.prompt_ids)):
        out.append({str(t): {"logprob": lp, "rank": rank,
                             "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
                    for t, lp, rank in _top(s, j, k)})
    return out


def echo_entries(s: SampleState, k: int) -> list[dict[int, float] | None]:
    """Per prompt token, {token id: logprob} of the top k and the token (None for the first),
    for the legacy logprobs of an echoed prompt."""
    if s.prompt_logprobs is None:
        return [None] * len(s.prompt_ids)
    return [None] + [{t: lp for t, lp, _ in _top(s, j, k)} for j in range(1, len(s.prompt_ids))]
