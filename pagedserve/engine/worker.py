"""The Worker: the model, its KV-cache tensors, attention backend and sampler on one device.

Start-up is one sequence, in `Worker.__init__`: load the weights -> profile a full step's
activation peak -> size the KV cache -> plan the small-batch matmuls -> capture the CUDA
graphs. On CUDA each phase is first rehearsed with its Triton kernels compiled in parallel
(`kernels/compile_ahead.py`). The warm-up steps come after, through the engine core
(`engine/warm_up.py`), because they exercise the scheduler and the step loop too; the
kernel variants that no step reaches are warmed here (`warm_up_kernels`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionContext, get_backend_class
from pagedserve.attention.long_prefill import MIN_KEYS as LONG_MIN_KEYS
from pagedserve.attention.long_prefill import MIN_QUERIES as LONG_MIN_QUERIES
from pagedserve.config import (
    EngineConfig,
    KernelConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.engine.cache_sizing import determine_num_blocks
from pagedserve.engine.kv_cache_spec import KVCacheSpec, check_kv_cache_device
from pagedserve.engine.kv_offload import build_offloader
from pagedserve.engine.messages import StepResult
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.engine.step_handle import StepHandle
from pagedserve.engine.warm_up import profile_forward
from pagedserve.engine.worker_info import WorkerInfo
from pagedserve.layers.sampler import Sampler
from pagedserve.lora.manager import LoRAManager
from pagedserve.models.loader import build_model
from pagedserve.models.source import ModelSource
from pagedserve.quantization.methods import check_quantization_device
from pagedserve.spec_decode.spec_decoder import SpecDecoder
from pagedserve.structured.backend import Grammar
from pagedserve.structured.compiler import GrammarCompiler
from pagedserve.structured.params import StructuredOutputsParams

logger = logging.getLogger("pagedserve")


def make_backend(name: str, device: torch.device, cfg: ModelConfig, tp: TensorParallel = SINGLE,
                 batch_invariant: bool = False) -> AttentionBackend:
    """The attention backend `name` ("auto": triton on CUDA, torch elsewhere) for `cfg`'s
    heads (a tensor-parallel rank's share of them) and its layers' sliding windows, if any;
    `batch_invariant`: in its batch-invariant mode (ValueError where it has none)."""
    if batch_invariant and device.type != "cpu":
        raise ValueError("--batch-invariant runs on the CPU only so far (the CUDA kernels' "
                         "fixed-order variants are not written yet): drop the flag or use --device cpu")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    backend = get_backend_class(name)(tp.split(cfg.num_heads, "the attention heads"),
                                      tp.split(cfg.num_kv_heads, "the KV heads"), cfg.head_dim,
                                      cfg.attention_scale, sliding_windows=cfg.sliding_windows or None)
    if batch_invariant:
        backend.set_batch_invariant()
    return backend


class Worker:
    """Runs the model on one device; `execute` launches a step, `collect` reads it back.
    `tp`: its tensor-parallel rank (its share of the model; `engine/tp_executor.py`). Its
    other public methods are what an executor's `collective_rpc` calls: plain data in and out."""

    def __init__(self, config: EngineConfig, source: ModelSource, tp: TensorParallel = SINGLE) -> None:
        t0 = time.perf_counter()
        # vLLM's --seed: the engine's random state (sampling of requests without a seed of
        # their own) starts from it, so a run is reproducible
        torch.manual_seed(config.seed)
        kernels = config.kernels
        self.device = device = config.resolved_device()
        self.cuda = device.type == "cuda"
        if self.cuda:
            from pagedserve.kernels import pdl
            from pagedserve.kernels.compile_ahead import report_late_compiles

            pdl.set_enabled(kernels.pdl)
            report_late_compiles(False)  # (this start-up's compiles are expected)
        check_kv_cache_device(config.cache.kv_cache_dtype, device,  # (before loading)
                              str(resolve_dtype(config.dtype, device)).removeprefix("torch."))
        check_quantization_device(config.quantization, device)
        model = build_model(source, dtype=config.dtype, device=device,
                            load_format=config.load_format, seed=config.seed,
                            quantization=config.quantization, tp=tp, max_model_len=config.scheduler.max_model_len)
        self.model_config = cfg = model.config
        self.dtype = dtype = resolve_dtype(config.dtype, device)
        # LoRA: slot tensors on every adaptable projection (before the KV cache is sized)
        lora = None if config.lora is None else LoRAManager(model, config.lora, cfg, dtype, device)
        self.scheduler_config = sched = config.scheduler_for(cfg, device.type)
        backend = make_backend(config.attention_backend, device, cfg, tp, config.batch_invariant)
        self.kv_spec = spec = KVCacheSpec.for_model(cfg, config.cache.block_size, dtype,
                                                    config.cache.kv_cache_dtype, tp.size)
        if self.cuda and sched.max_model_len >= LONG_MIN_KEYS and backend.enable_long_prefill(
                kernels.long_prefill, getattr(torch, spec.dtype), device):
            logger.info("long-context prefill chunks (%d+ tokens over %d+ keys) on %s attention",
                        LONG_MIN_QUERIES, LONG_MIN_KEYS, kernels.long_prefill)
        self._compile_ahead = self.cuda and kernels.compile_ahead
        self.compile_ahead_seconds = 0.0
        self.model = model

        draft = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            draft = self._build_draft(config, device, cfg, dtype, tp)
        self._cached_plans = self._read_plan_cache(kernels)  # (None: none kept, or the plan is off)
        self._plan_rehearsed = False

        def profile() -> None:  # (with compile-ahead: its rehearsal also compiles the matmul
            # plan's candidates and the fused samplers, so that they compile in parallel with it)
            if self._compile_ahead:
                self._rehearse(lambda: self._first_compiles(backend, sched, spec, kernels),
                               "memory profile, matmul plan, samplers")
                self._plan_rehearsed = True
            profile_forward(model, backend, sched, spec)

        num_blocks = determine_num_blocks(
            spec, config.cache, sched, device, profile=profile,
            extra_bytes_per_block=draft[2].bytes_per_block if draft else 0)
        if tp.size > 1:  # the core keeps one block table for all ranks: the smallest one's
            blocks = torch.tensor([num_blocks], device=device)
            num_blocks = int(tp.all_reduce_min(blocks))
        drafter = None
        if draft is not None:
            from pagedserve.spec_decode.draft_model import DraftRunner

            drafter = DraftRunner(*draft, num_blocks, sched, config.speculative.num_speculative_tokens)
        # compiled grammars by constraint: the core's where it shares them (in process), else
        # this worker's own, built on first use
        self.grammar_compiler: GrammarCompiler | None = None
        self._source, self._tokenizer_path = source, config.tokenizer
        self.runner = ModelRunner(model, backend, spec, num_blocks, Sampler(kernels.fused_sampling, kernels.top_k_top_p_kernel),
                                  sched, SpecDecoder(config.speculative, drafter), self._grammar, lora)
        self.num_blocks = num_blocks
        self.kv_tiers, *self._tier_sizes = build_offloader(  # (None: no host or disk tier)
            config, source, self.runner.kv_caches, spec, str(dtype), tp.rank, tp.size)

        self.matmul_plan_seconds = 0.0
        if device.type == "cpu":
            from pagedserve.layers.cpu_matmul import pack_model_weights

            rows = min(sched.max_num_seqs, 64)
            packed = sum(pack_model_weights(m, rows, config.batch_invariant)
                         for m in (model, *(draft[:1] if draft else ())))
            logger.info("%d weights packed for oneDNN", packed)
        if self._plans_wanted(kernels):
            self.matmul_plan_seconds = self._plan_matmuls(kernels)

        self.graph_capture_seconds = 0.0
        if self.cuda and not config.enforce_eager and backend.supports_cuda_graphs():
            # verify graphs up to the batch size above which steps do not speculate
            verify_batch = min(config.speculative.disable_by_batch_size, 512) if config.speculative else 0
            self.graph_capture_seconds = self.runner.enable_cuda_graphs(
                min(sched.max_num_seqs, 512), kernels.mixed_graph_tokens, sched.max_model_len,
                prefetch=kernels.weight_prefetch, ahead=self._rehearse if self._compile_ahead else None,
                max_verify_batch=verify_batch)
            if drafter is not None:
                self.graph_capture_seconds += drafter.enable_cuda_graphs(
                    min(sched.max_num_seqs, 512), kernels.mixed_graph_tokens, sched.max_model_len,
                    self.runner.verify_len, verify_batch)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s); max concurrency at "
            "max_model_len=%d: %.2fx", num_blocks, spec.block_size, num_blocks * spec.block_size,
            num_blocks * spec.bytes_per_block / 2**30, spec.describe(dtype), sched.max_model_len,
            num_blocks * spec.block_size / sched.max_model_len,
        )
        self.load_seconds = time.perf_counter() - t0

    # ---- start-up helpers -------------------------------------------------------------

    def _build_draft(self, config: EngineConfig, device: torch.device, cfg: ModelConfig, dtype: torch.dtype,
                     tp: TensorParallel):
        """(model, attention backend, KV spec) of the speculative draft model, split over the
        tensor-parallel ranks as the model is (this rank's share)."""
        from pagedserve.models.source import resolve_model

        spec = config.speculative
        source = resolve_model(spec.model, load_format=config.load_format)
        model = build_model(source, dtype=config.dtype, device=device, load_format=config.load_format,
                            seed=config.seed, tp=tp, max_model_len=config.scheduler.max_model_len)
        if model.config.vocab_size != cfg.vocab_size:
            raise ValueError(f"the draft model {spec.model} has a vocabulary of {model.config.vocab_size} "
                             f"tokens, the model {cfg.vocab_size}: they must be the same")
        return (model, make_backend(config.attention_backend, device, model.config, tp, config.batch_invariant),
                KVCacheSpec.for_model(model.config, config.cache.block_size, dtype,
                                      config.cache.kv_cache_dtype, tp.size))

    def _plan_matmuls(self, kernels: KernelConfig) -> float:
        """Give the model's small-batch matmuls a plan: the one kept by an earlier start-up
        under the same conditions (`layers/plan_cache.py`), else a timed one, then kept.
        Returns the seconds it took."""
        from pagedserve.layers.linear import (
            apply_matmul_plans,
            compile_plan_candidates,
            plan_model_matmuls,
        )

        t0 = time.perf_counter()
        model = self.model
        if self._cached_plans is not None:
            cache, key, _ = self._plan_cache
            apply_matmul_plans(model, self._cached_plans)
            logger.info("small-batch matmul plans read from %s", cache.path(key))
        else:
            if self._compile_ahead and not self._plan_rehearsed:  # (no memory profile: a set KV size)
                self._rehearse(lambda: compile_plan_candidates(model), "matmul plan")
            plans = plan_model_matmuls(model)
            if self._plan_cache is not None:
                cache, key, about = self._plan_cache
                cache.store(key, plans, about)
        seconds = time.perf_counter() - t0
        logger.info("small-batch matmuls planned in %.1f s", seconds)
        return seconds

    def _plans_wanted(self, kernels: KernelConfig) -> bool:
        """Whether this start-up gives the small-batch matmuls a plan (`_plan_matmuls`)."""
        return self.cuda and self.dtype in (torch.bfloat16, torch.float16) and kernels.skinny_matmul

    def _read_plan_cache(self, kernels: KernelConfig) -> dict | None:
        """The plans an earlier start-up kept under this one's conditions
        (`layers/plan_cache.py`), or None. Sets `_plan_cache`: (cache, key, what the key was made
        of), where a plan is wanted and kept on disk, for `_plan_matmuls` to store a new one."""
        self._plan_cache = None
        if not (self._plans_wanted(kernels) and kernels.plan_cache_dir):
            return None
        from pagedserve.layers.linear import plan_groups
        from pagedserve.layers.plan_cache import PlanCache, device_facts, plan_key

        facts, groups = device_facts(self.device), plan_groups(self.model)
        cache, key = PlanCache(kernels.plan_cache_dir), plan_key(facts, groups, kernels.pdl)
        self._plan_cache = (cache, key, {"device": facts, "groups": groups, "pdl": kernels.pdl})
        return cache.load(key)

    def _first_compiles(self, backend, sched: SchedulerConfig, spec: KVCacheSpec, kernels: KernelConfig) -> None:
        """The first rehearsal's work: the memory profile's forward, and, as they need no KV
        cache, the matmul plan's candidates (unless a kept plan is read) and the fused samplers."""
        from pagedserve.layers.linear import compile_plan_candidates

        profile_forward(self.model, backend, sched, spec)
        if self._plans_wanted(kernels) and self._cached_plans is None:
            compile_plan_candidates(self.model)
        self._sampler_kernels(kernels.fused_sampling, kernels.fused_sampling and kernels.top_k_top_p_kernel,
                              sched.max_num_seqs)

    def _rehearse(self, fn: Callable[[], object], what: str) -> None:
        """Run `fn` over the first two decoder layers with its Triton kernels compiled in
        parallel instead of launched (`kernels/compile_ahead.py`)."""
        from pagedserve.kernels.compile_ahead import compile_ahead

        with self.model.first_layers_only(2):
            self.compile_ahead_seconds += compile_ahead(fn, what)

    def rehearsed(self, fn: Callable[[], object], what: str) -> float:
        """Run a start-up phase, rehearsed first where compile-ahead is on; the seconds the
        rehearsal took (0 without one)."""
        before = self.compile_ahead_seconds
        if self._compile_ahead:
            self._rehearse(fn, what)
        fn()
        return self.compile_ahead_seconds - before

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Kernel variants no warm-up step reaches: the attention backend's eager variants
        (e.g. every split-KV count of the Triton decode kernel: measured on the H200, each
        first use otherwise stalls a serving step by about half a second) and the fused
        samplers (the warm-up's requests are greedy), on logits in the model's dtype."""
        if not self.cuda:
            return
        runner, backend = self.runner, self.runner.backend
        builder = runner.buffers.builder
        if builder.has_eager_variants:
            length = min(600, self.scheduler_config.max_model_len)
            ids, positions, meta = runner.decode_probe(num_seqs=2, length=length)
            for variant in builder.eager_variants(meta):
                self.model(ids, positions, AttentionContext(backend, variant))
        self._sampler_kernels(runner.sampler.fused, runner.sampler.fused_top_k_top_p,
                              self.scheduler_config.max_num_seqs)

    def _sampler_kernels(self, fused: bool, fused_top_k_top_p: bool, max_num_seqs: int) -> None:
        """Launch the fused samplers at 1 and max_num_seqs rows, on logits in the model's dtype."""
        if not fused:
            return
        from pagedserve.kernels.sampling import sample_with_temperature

        for rows in sorted({1, max_num_seqs}):
            logits = torch.zeros(rows, self.model_config.vocab_size, device=self.device, dtype=self.dtype)
            ones = torch.ones(rows, device=self.device)
            sample_with_temperature(logits, ones, seed=1)
            if fused_top_k_top_p and self.dtype == torch.bfloat16:
                from pagedserve.kernels.top_k_top_p_sampling import sample_top_k_top_p

                sample_top_k_top_p(logits, ones, torch.ones(rows, device=self.device, dtype=torch.int64),
                                   ones, seed=1)

    def report_late_compiles(self) -> None:
        """From now on, log every Triton kernel variant first launched (a warm-up gap)."""
        if self.cuda:
            from pagedserve.kernels.compile_ahead import report_late_compiles

            report_late_compiles(True)

    def _grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """A constraint's compiled grammar (for a new request's matcher)."""
        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler.for_model(self._source, self.model_config,
                                                              self._tokenizer_path)
        return self.grammar_compiler.get(spec)

    # ---- steps ------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> StepHandle | None:
        """Forget the requests that ended since the last step, then launch this one (None:
        it has no chunks)."""
        self.runner.release(out.finished_req_ids)
        if out.kv_copies is not None:  # (before the forward pass: engine/kv_tiers.py)
            self.kv_tiers.run(out.kv_copies)
        return self.runner.execute(out) if out.chunks else None

    def collect(self, handle: StepHandle) -> StepResult:
        result = self.runner.collect(handle)
        if self.kv_tiers is not None:
            result.kv_tiers = self.kv_tiers.report()
        return result

    # ---- calls through the executor's collective_rpc ----------------------------------

    def info(self) -> WorkerInfo:
        """The start-up facts the engine core needs."""
        drafter = self.runner.drafter
        return WorkerInfo(
            model_config=self.model_config, scheduler_config=self.scheduler_config, num_blocks=self.num_blocks,
            block_size=self.kv_spec.block_size,
            draft_layer_windows=None if drafter is None else drafter.model.config.sliding_windows,
            is_cuda=self.cuda, load_seconds=self.load_seconds, graph_capture_seconds=self.graph_capture_seconds,
            matmul_plan_seconds=self.matmul_plan_seconds, compile_ahead_seconds=self.compile_ahead_seconds,
            kv_tier_sizes=tuple(self._tier_sizes[:2]), kv_disk_digests=tuple(self._tier_sizes[2]))

    def graph_counts(self) -> tuple[int, int]:
        """(steps replayed from CUDA graphs, eager steps) since the last reset."""
        return self.runner.num_graph_steps, self.runner.num_eager_steps

    def last_launch_ms(self) -> tuple[float, float, float]:
        """Host ms of the last launch: inputs, model, logits and sampling (for slow-step logs)."""
        return self.runner.last_launch_ms

    def grammar_seconds(self) -> tuple[float, float]:
        """Cumulative host seconds of structured output: waiting for the previous step's
        tokens before building grammar masks, and building them."""
        wait, fill = self.runner.grammar_seconds
        return wait, fill

    def set_eager_mixed(self, on: bool) -> None:
        """While on, prefill and mixed steps run eagerly (for the warm-up)."""
        if self.runner.graphs is not None:
            self.runner.graphs.use_mixed = not on

    def propose_drafts(self, requests: list[tuple[str, list[int], list[int], int]]) -> dict[str, list[int]]:
        """Speculative drafts from the draft model: (request id, verified tokens, block ids,
        number of drafts) of each request -> its drafts (`spec_decode/draft_model.py`)."""
        if self.runner.drafter is None:
            raise RuntimeError("propose_drafts was called, but this worker has no draft model")
        return self.runner.drafter.propose(requests)

    def reset_stats(self) -> None:
        """Zero the step counters (after the warm-up)."""
        self.runner.reset_stats()

    def close(self) -> None:
        """Finish what must outlive the worker: the disk tier's pending writes."""
        if self.kv_tiers is not None and self.kv_tiers.disk is not None:
            self.kv_tiers.disk.close()

    def held_request_ids(self) -> list[str]:
        """The requests this worker keeps state (or a block table) for: every one no step's
        finished_req_ids named yet (the ended ones go with the next step)."""
        return sorted(set(self.runner.requests) | set(self.runner.tables.row_of))

    def on_progress(self, beat: Callable[[], None]) -> None:
        """(In process only: `beat` is a callable.) On the CPU, call it before each decoder
        layer of a forward pass (one 8,000-token prefill step of SmolLM2 took about 400 s on 2
        busy cores). Not on a GPU: its host runs ahead of the device, so a layer launched is
        no progress, and steps take milliseconds."""
        if not self.cuda:
            for layer in self.model.layers:
                layer.register_forward_pre_hook(lambda *_: beat())
