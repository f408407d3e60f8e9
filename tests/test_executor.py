"""The engine core over a fake executor: the core needs nothing of the model but the
`Executor` interface (what a tensor-parallel executor will implement)."""

from __future__ import annotations

from contextlib import nullcontext

from pagedserve.config import EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.engine.core import EngineCore
from pagedserve.engine.executor import Executor
from pagedserve.engine.messages import EngineRequest, StepResult
from pagedserve.models.source import ModelSource
from pagedserve.sampling_params import SamplingParams

VOCAB, EOS = 500, 3


def next_token(tokens: list[int]) -> int:
    """The fake model: the next token depends on the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % VOCAB


class FakeExecutor(Executor):
    """Computes each sampling chunk's token from its request's known tokens at launch."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4) -> None:
        self.model_config = ModelConfig("LlamaForCausalLM", VOCAB, 8, 8, 1, 1, 1, 8, 1e-6, 1e4,
                                        max_position_embeddings=256, tie_word_embeddings=True,
                                        qk_norm=False, eos_token_ids=(EOS,))
        self.scheduler_config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.load_seconds = self.graph_capture_seconds = self.matmul_plan_seconds = 0.0
        self.compile_ahead_seconds, self.is_cuda = 0.0, False
        self.steps, self.released = 0, []
        self.tokens: dict[str, list[int]] = {}  # what a worker keeps: each request's known tokens

    def execute(self, out, *unexpected):
        assert not unexpected  # the step's message is all a worker gets
        self.steps += 1
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.prompt_token_ids)
        sampled = {}
        for c in out.chunks:
            assert len(c.block_ids) * self.block_size >= c.start + c.num_tokens
            if c.samples:  # (synchronous engine: every input token is known)
                known = self.tokens[c.request_id]
                assert len(known) == c.start + c.num_tokens
                sampled[c.request_id] = [next_token(known)]
        return sampled

    def collect(self, handle) -> StepResult:
        for rid, new in handle.items():
            if rid in self.tokens:
                self.tokens[rid] += new
        return StepResult(handle, {})

    def release(self, request_ids):
        self.released += request_ids
        for rid in request_ids:
            self.tokens.pop(rid, None)

    def graph_counts(self):
        return 0, self.steps

    def last_launch_ms(self):
        return 0.0, 0.0, 0.0

    def grammar_seconds(self):
        return 0.0, 0.0

    def rehearsed(self, fn, what):
        fn()

    def eager_mixed_steps(self):
        return nullcontext()

    def warm_up_kernels(self):
        pass

    def report_late_compiles(self):
        pass

    def reset_stats(self):
        self.steps = 0


def test_the_core_runs_on_any_executor():
    ex = FakeExecutor()
    config = EngineConfig(async_scheduling=False)
    core = EngineCore(config, ModelSource("fake", {}), executor=ex)
    prompts = {f"r{i}": [10 + i] * (3 + 7 * i) for i in range(6)}  # chunked: budget 16 tokens
    for rid, prompt in prompts.items():
        core.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    got = {rid: [] for rid in prompts}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.request_id] += o.new_token_ids
    for rid, prompt in prompts.items():
        seq = list(prompt)
        for _ in range(5):
            seq.append(next_token(seq))
        assert got[rid] == seq[len(prompt):], rid
    assert sorted(ex.released) == sorted(prompts)  # each finished request's state dropped
    core.kv.check_integrity(expect_all_free=True)


def test_the_worker_takes_its_kernel_choices_from_the_config(tmp_path):
    """(CPU) The sampler's fused kernel follows KernelConfig.fused_sampling."""
    from conftest import make_hf_checkpoint
    from pagedserve.config import CacheConfig, KernelConfig
    from pagedserve.engine.worker import Worker
    from pagedserve.models.source import resolve_model

    make_hf_checkpoint("llama", tmp_path)
    for fused in (True, False):
        config = EngineConfig(model=str(tmp_path), device="cpu", kernels=KernelConfig(fused_sampling=fused),
                              cache=CacheConfig(kv_cache_memory=8 << 20))
        assert Worker(config, resolve_model(str(tmp_path))).runner.sampler.fused is fused
