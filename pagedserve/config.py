"""Frozen, validated configuration dataclasses.

`ModelConfig` is built from a Hugging Face `config.json` dict; engine-level configs
(cache, scheduler) live here too so there is one place to read what can be tuned. This
module imports no torch (the HTTP process builds these configs too): the few methods that
speak in torch types import it when called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pagedserve.faults import FaultPlan
from pagedserve.lora.config import LoRAConfig
from pagedserve.models.moe_config import MoeConfig
from pagedserve.models.rope_scaling import RopeScaling
from pagedserve.pooling_params import PoolerConfig
from pagedserve.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

# user-facing dtype names -> torch dtype names
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
# --kv-cache-dtype names -> the torch dtype name the KV cache is stored in (auto: the model's
# dtype); vLLM's names for the FP8 formats it reads on these GPUs
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """Turn a user-facing dtype ("auto", "bfloat16", torch.float16, ...) into a torch dtype.

    "auto" (or None) means bfloat16 on CUDA and float32 on the CPU.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return getattr(torch, DTYPE_NAMES[str(dtype).lower()])
    except KeyError:
        raise ValueError(
            f"dtype {dtype!r} is not supported; choose one of auto, float32, bfloat16, float16"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the decoder needs, read from a HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False
    rope_scaling: RopeScaling | None = None
    rotary_dim: int = 0  # dimensions of each head RoPE rotates (0: all, Phi-4-mini: 3/4)
    no_rope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3)
    sliding_windows: tuple[int | None, ...] = ()  # per layer: keys a query sees (None: all; empty: no window)
    sliding_rope_theta: float | None = None  # the sliding layers' own RoPE base (Gemma 3), unscaled
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh (Gemma)
    embedding_multiplier: float = 1.0  # embeddings scaled by it (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # softmax scale 1/sqrt(it) instead of 1/sqrt(head_dim) (Gemma)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    norm_round_once: bool = False  # RMSNorms: float32 weights, one rounding after the weight (Gemma)
    moe: MoeConfig | None = None  # a mixture-of-experts model's sparse layers (Qwen3-MoE)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

        if self.no_rope_layers and self.rope_scaling and self.rope_scaling.attention_factor != 1.0:
            raise ValueError(f"RoPE scaling {self.rope_scaling.kind!r} with layers without RoPE "
                             "(no_rope_layers) is not supported yet")

    @property
    def partial_rotation(self) -> bool:
        """RoPE rotates only the first rotary_dim dimensions of each head (Phi-4-mini)."""
        return 0 < self.rotary_dim < self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k: 1/sqrt(head_dim) (Gemma: 1/sqrt(query_pre_attn_scalar)), times the square of YaRN's or
        LongRoPE's attention factor (Transformers multiplies cos and sin, so q and k, by it).
        With a partial rotation the factor scales the rotated dimensions only: the loader
        folds it into those rows of q's and k's weights instead (`LlamaForCausalLM`)."""
        factor = self.rope_scaling.attention_factor if self.rope_scaling and not self.partial_rotation else 1.0
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * factor * factor

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count computed from the shapes, without allocating anything."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        total = self.num_layers * per_layer + embeddings + h
        if self.moe:  # sparse layers: the router and every expert in place of the dense MLP
            sparse = self.moe.num_experts * (h + 3 * h * self.moe.intermediate_size) - 3 * h * i
            total += len(self.moe.layers) * sparse
        return total

    def expert_parameters(self) -> int:
        """Parameters of one expert in every sparse layer (0 without experts)."""
        return 3 * self.hidden_size * self.moe.intermediate_size * len(self.moe.layers) if self.moe else 0

    def active_parameters(self) -> int:
        """Parameters a token runs through: all but the experts it is not routed to."""
        if not self.moe:
            return self.num_parameters()
        return self.num_parameters() - (self.moe.num_experts - self.moe.top_k) * self.expert_parameters()


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits for one engine step."""

    # a step's tokens when none is given, by device: on the CPU 8192 take seconds (performance.md)
    DEFAULT_BATCHED_TOKENS: ClassVar[dict[str, int]] = {"cuda": 8192, "cpu": 512}
    max_num_seqs: int = 256  # most requests running at once
    max_num_batched_tokens: int | None = None  # a step's tokens; None: the device's (scheduler_for)
    max_model_len: int = 4096  # prompt + output limit per request

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is None and name != "max_num_batched_tokens" or value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; overrides gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # fraction of the GPU's memory pagedserve may use
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: auto (the model's dtype), fp8 / fp8_e4m3

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; choose one "
                             f"of {', '.join(KV_CACHE_DTYPES)}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class KVTierConfig:
    """The KV-cache hierarchy below the GPU's blocks (engine/kv_tiers.py): evicted prefix
    blocks kept in host memory and, optionally, in files that outlive the process."""

    offload_bytes: int = 0  # host memory for evicted blocks (--kv-offload-size); 0 = no host tier
    cache_dir: str | None = None  # the disk tier's directory (--kv-cache-dir); None = no disk tier
    cache_dir_bytes: int = 8 << 30  # most bytes of block files kept there (--kv-cache-dir-size)

    def __post_init__(self) -> None:
        if self.offload_bytes < 0:
            raise ValueError(f"kv_offload_size must be >= 0 GiB, got {self.offload_bytes / 2**30:g}")
        if self.cache_dir is not None and self.cache_dir_bytes <= 0:
            raise ValueError("kv_cache_dir_size must be positive GiB")

    @property
    def enabled(self) -> bool:
        return self.offload_bytes > 0 or self.cache_dir is not None


LONG_PREFILL_KERNELS = ("off", "flash", "cudnn", "math")


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices of the engine (every default is the measured winner on the H200 or H100; the
    switches exist for A/B measurements, `envs.kernel_config` reads them from $PAGEDSERVE_*)."""

    skinny_matmul: bool = True  # time the skinny Triton matmul against cuBLAS at start-up (CUDA, 16-bit)
    pdl: bool = True  # programmatic dependent launch of the Triton kernels (compute capability 9.0+)
    fused_sampling: bool = True  # temperature-only batches sampled by one Triton kernel
    # batches whose random rows all have a top-k (<= 1,024) sampled by the Triton radix select
    # (kernels/top_k_top_p_sampling.py; H100: 2-6x faster than torch's sort or top-k window)
    top_k_top_p_kernel: bool = True
    weight_prefetch: bool = True  # L2 weight prefetch beside decode graphs of up to 16 rows (Hopper)
    compile_ahead: bool = True  # rehearse each CUDA start-up phase with Triton compiles in parallel
    mixed_graph_tokens: int = 2048  # largest prefill/mixed step replayed from a CUDA graph (0 = none)
    plan_cache_dir: str | None = None  # where the matmul plans of earlier start-ups are kept (None = nowhere)
    # long-context prefill chunks of eager steps on torch's fused attention (CUDA, 16-bit;
    # attention/long_prefill.py): "cudnn" (measured fastest: 1.83x the Triton extend kernel on
    # a 250,000-token prompt), "flash", "math" or "off" (the Triton extend kernel)
    long_prefill: str = "cudnn"

    def __post_init__(self) -> None:
        if self.mixed_graph_tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be >= 0, got {self.mixed_graph_tokens}")
        if self.long_prefill not in LONG_PREFILL_KERNELS:
            raise ValueError(f"long_prefill must be one of {', '.join(LONG_PREFILL_KERNELS)}, "
                             f"got {self.long_prefill!r}")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Engine-step logging and tracing (all off by default; `envs.observability_config`)."""

    slow_step_ms: float = 0.0  # log steps slower than this, with their make-up (0 = off)
    step_times_every: int = 0  # every N steps, log host milliseconds per step phase (0 = off)
    step_trace: str | None = None  # append each step's make-up and GPU times to this JSONL file


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine core (built once: `EngineArgs.create_engine_config`)."""

    model: str | None = None  # None = embedded default model; else preset, folder or .gguf
    tokenizer: str | None = None  # None = the model's own (structured output compiles with it)
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda if available, else cpu
    load_format: str = "auto"
    seed: int = 0  # for dummy weights
    quantization: str | None = None  # the method the decoder runs (pagedserve/quantization/)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention_backend: str = "auto"  # "auto" = triton on CUDA, torch elsewhere
    enforce_eager: bool = False
    async_scheduling: bool = True  # overlap host scheduling with the GPU (see EngineCore.step)
    faults: FaultPlan = field(default_factory=FaultPlan)  # chaos tests only (faults.py)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding (spec_decode/); None = off
    tensor_parallel_size: int = 1  # worker processes the model is split across (engine/tp_executor.py)
    # "mp": a worker process per rank (engine/tp_executor.py); "uni": one in-process worker;
    # None: "mp" when tensor_parallel_size > 1, else "uni" (vLLM's names)
    distributed_executor_backend: str | None = None
    # engine cores behind one server (`serve --data-parallel-size`), and which one this is:
    # on CUDA it runs on GPUs first_gpu .. first_gpu + tensor_parallel_size - 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # every reduction in one order per row, whatever else the step holds (docs/architecture.md,
    # "Batch invariance"): a request's tokens are the same alone or in any batch
    batch_invariant: bool = False
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)  # host and disk tiers (off)
    lora: LoRAConfig | None = None  # LoRA adapters (lora/); None: --enable-lora not given
    # a pooling model (`--runner pooling`: embeddings or scores, prefill-only); None = generation
    pooler: PoolerConfig | None = None

    @property
    def first_gpu(self) -> int:
        """The CUDA device index of this core's first (tensor-parallel rank 0) GPU."""
        return self.data_parallel_rank * self.tensor_parallel_size

    @property
    def multiprocess_executor(self) -> bool:
        return self.tensor_parallel_size > 1 or self.distributed_executor_backend == "mp"

    def scheduler_for(self, model_cfg: ModelConfig, device_type: str | None = None) -> SchedulerConfig:
        """The limits with max_model_len clamped to the model's, and the step's token budget,
        if none was given, `device_type`'s (DEFAULT_BATCHED_TOKENS; CUDA's for any other)."""
        s, default = self.scheduler, SchedulerConfig.DEFAULT_BATCHED_TOKENS
        budget = s.max_num_batched_tokens or default.get(device_type, default["cuda"])
        return SchedulerConfig(s.max_num_seqs, budget, min(s.max_model_len, model_cfg.max_position_embeddings))

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
