"""The engine core over a fake executor: the core needs nothing of the model but the
`Executor` verbs (execute, collect, collective_rpc) and the workers' `WorkerInfo`."""

from __future__ import annotations

from pagedserve.config import EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.engine.block_tables import BlockTables
from pagedserve.engine.core import EngineCore
from pagedserve.engine.executor import Executor
from pagedserve.engine.messages import EngineRequest, StepResult
from pagedserve.engine.worker_info import WorkerInfo
from pagedserve.models.source import ModelSource
from pagedserve.sampling_params import SamplingParams

VOCAB, EOS, BLOCK_SIZE = 500, 3, 4


def next_token(tokens: list[int]) -> int:
    """The fake model: the next token depends on the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % VOCAB


class FakeWorker:
    """The worker side: what a real worker keeps (each request's known tokens) and the
    methods the core calls through `collective_rpc`."""

    def __init__(self) -> None:
        self.steps, self.released = 0, []
        self.tokens: dict[str, list[int]] = {}
        self.tables = BlockTables(max_blocks=4)  # each request's block table, from the steps' diffs

    def execute(self, out):
        self.released += out.finished_req_ids
        for rid in out.finished_req_ids:  # (before the new requests: an id may be reused)
            self.tokens.pop(rid, None)
            self.tables.drop(rid)
        if not out.chunks:
            return None
        self.steps += 1
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.prompt_token_ids)
        self.tables.apply(out)
        sampled = {}
        for c in out.chunks:
            assert len(self.tables.block_ids(c.request_id)) * BLOCK_SIZE >= c.start + c.num_tokens
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

    def graph_counts(self):
        return 0, self.steps

    def last_launch_ms(self):
        return 0.0, 0.0, 0.0

    def grammar_seconds(self):
        return 0.0, 0.0

    def set_eager_mixed(self, on):
        pass

    def warm_up_kernels(self):
        pass

    def report_late_compiles(self):
        pass

    def reset_stats(self):
        self.steps = 0


class FakeExecutor(Executor):
    """The three verbs over a `FakeWorker`, which computes each sampling chunk's token from
    its request's known tokens at launch."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.info = WorkerInfo(
            ModelConfig("LlamaForCausalLM", VOCAB, 8, 8, 1, 1, 1, 8, 1e-6, 1e4, max_position_embeddings=256,
                        tie_word_embeddings=True, qk_norm=False, eos_token_ids=(EOS,)),
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128),
            num_blocks, BLOCK_SIZE, draft_layer_windows=None, is_cuda=False, load_seconds=0.0,
            graph_capture_seconds=0.0, matmul_plan_seconds=0.0, compile_ahead_seconds=0.0)
        self.worker = FakeWorker()

    def execute(self, out, *unexpected):
        assert not unexpected  # the step's message is all a worker gets
        return self.worker.execute(out)

    def collect(self, handle) -> StepResult:
        return self.worker.collect(handle)

    def collective_rpc(self, method, *args):
        return [getattr(self.worker, method)(*args)]


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
    core.kv.check_integrity(expect_all_free=True)
    # Each finished request's state is dropped at the start of the next step (no call of its
    # own): those that finished in the last step go with the next request's first step.
    assert set(ex.worker.released) < set(prompts)
    core.add_request(EngineRequest("next", [5, 6, 7], SamplingParams(max_tokens=1)))
    while core.has_unfinished_requests():
        core.step()
    assert sorted(ex.worker.released) == sorted(prompts)
    assert set(ex.worker.tokens) == {"next"}


def test_a_step_that_fails_before_it_reaches_the_workers_sends_its_finished_ids_again():
    """A finished id rides on the next step; if that step raises before the workers get it,
    the one after carries it again, and a step without chunks still carries it."""
    ex = FakeExecutor()
    core = EngineCore(EngineConfig(async_scheduling=False), ModelSource("fake", {}), executor=ex)
    core.add_request(EngineRequest("a", [9] * 5, SamplingParams(max_tokens=1)))
    while core.has_unfinished_requests():
        core.step()
    assert ex.worker.released == [] and set(ex.worker.tokens) == {"a"}
    real = ex.execute

    def fails(out):
        raise RuntimeError("the pipe broke")

    ex.execute = fails
    core.add_request(EngineRequest("b", [8] * 5, SamplingParams(max_tokens=1)))
    outputs = core.step()  # (b fails with the step)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("b", "error")]
    ex.execute = real
    assert not core.has_unfinished_requests()
    core.step()  # nothing to run: a step of finished ids alone
    assert sorted(ex.worker.released) == ["a", "b"] and not ex.worker.tokens


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
