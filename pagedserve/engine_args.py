"""`EngineArgs`: the one list of the engine's user-facing settings, and the one place they
become a frozen `EngineConfig`.

`LLM(model, **kwargs)`, the CLI's engine flags (`cli/engine_args.py`: a flag per field, of the
same name), the server launcher and the Ray replicas all build an `EngineArgs`;
`create_engine_config` resolves the model (a Hub id is downloaded here, once), checks the
settings against it, and reads the kernel and logging switches from the environment
(`envs.py`). Nothing below this module resolves a model or reads the environment for it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any

from pagedserve import envs
from pagedserve.config import CacheConfig, EngineConfig, KVTierConfig, ModelConfig, SchedulerConfig
from pagedserve.distributed.split import check_config_split, check_quantized_split
from pagedserve.faults import FaultPlan
from pagedserve.lora.config import LoRAConfig
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.pooling import detect_pooler, resolve_pooler
from pagedserve.models.source import ModelSource, resolve_model
from pagedserve.quantization import check_moe_quantization, resolve_quantization, split_units
from pagedserve.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class EngineArgs:
    """The engine's settings as a user gives them (vLLM's names and meanings; the CLI flag of
    each is its name with dashes). Plain values: nothing here is resolved or checked until
    `create_engine_config`."""

    model: str | None = None  # None: the embedded SmolLM2; else a preset, Hub id, folder or .gguf
    tokenizer: str | None = None  # None: the model's own
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None  # None: the model's limit
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the device's default (SchedulerConfig)
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; None: sized from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: dict | str | None = None  # vLLM's JSON or a dict
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine cores behind one server (`serve` only)
    distributed_executor_backend: str | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    async_scheduling: bool = True
    seed: int = 0
    revision: str | None = None  # Hub ids: branch, tag or commit
    download_dir: str | None = None  # Hub ids: where to find and download them
    generation_config: str = "auto"  # sampling defaults: auto, vllm or a folder
    inject_faults: str | None = None  # chaos tests only (faults.py)
    batch_invariant: bool = False  # the same tokens for a request whatever else is in its batch
    # the KV-cache hierarchy (engine/kv_tiers.py): GiB of host memory for evicted prefix
    # blocks (0: off), a directory for block files that outlive the process, its cap in GiB
    kv_offload_size: float = 0
    kv_cache_dir: str | None = None
    kv_cache_dir_size: float = 8
    # LoRA adapters (lora/): off unless enable_lora
    enable_lora: bool = False
    max_loras: int = 1  # adapters in device slots at once (and distinct ones in one step)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)
    # pooling models (embeddings, scores): vLLM's --runner auto|generate|pooling, --convert
    # auto|none|embed|score and --pooler-config JSON; auto: the checkpoint decides (models/pooling.py)
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict | str | None = None

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        """From parsed engine flags (`cli/engine_args.add_engine_args`); `--model` wins over
        the positional model."""
        if not getattr(args, "enable_chunked_prefill", True):
            raise ValueError("--no-enable-chunked-prefill is not supported: pagedserve always "
                             "chunks long prefills (drop the flag)")
        # (a flag left at None where the field has a default: the field's default; e.g.
        # --gpu-memory-utilization, whose None tells a given value from the default)
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)
                 and (getattr(args, f.name) is not None or f.default is None)}
        given["model"] = getattr(args, "model_opt", None) or args.model
        return cls(**given)

    def create_engine_config(self) -> tuple[EngineConfig, ModelSource, ModelConfig]:
        """Resolve the model, check every setting against it (max_model_len against its limit,
        the tensor-parallel split, a draft model's vocabulary), and build the frozen config.
        Returns (config, the resolved model source, its ModelConfig); ValueError names a bad
        setting and its fix."""
        source = resolve_model(self.model, load_format=self.load_format, revision=self.revision,
                               download_dir=self.download_dir)
        if source.is_preset and self.load_format != "dummy":
            raise ValueError(f"preset {source.name!r} ships no weights: add --load-format dummy "
                             "(load_format='dummy') for random weights, or name a model folder "
                             "or a Hugging Face Hub id (e.g. Qwen/Qwen3-4B-Instruct-2507)")
        model = str(source.folder) if source.from_hub else self.model  # (the core loads the folder)
        quantization = resolve_quantization(self.quantization, source.hf_config)
        model_cfg = model_config_from_hf(source.hf_config)
        check_moe_quantization(quantization, model_cfg.moe is not None)
        self._check_batch_invariant(quantization)
        limit = model_cfg.max_position_embeddings
        max_len = self.max_model_len or limit
        if max_len > limit:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings "
                             f"({limit}); lower --max-model-len")
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and spec.method == "draft_model":
            spec = _checked_draft(spec, model_cfg, self.load_format, self.tensor_parallel_size)
        check_tensor_parallel(self.tensor_parallel_size, model_cfg, quantization,
                              source.hf_config.get("quantization_config"),
                              self.distributed_executor_backend)
        check_data_parallel(self.data_parallel_size, self.device)
        pooler = resolve_pooler(self.runner, self.convert, self.pooler_config, detect_pooler(source))
        if pooler is not None and spec is not None:
            raise ValueError("speculative decoding does not apply to a pooling model (it never "
                             "decodes): drop --speculative-config")
        config = EngineConfig(
            model=model, tokenizer=self.tokenizer, dtype=self.dtype, device=self.device,
            load_format=self.load_format, seed=self.seed, quantization=quantization,
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_len),
            cache=CacheConfig(self.block_size, self.enable_prefix_caching, self.kv_cache_memory,
                              self.gpu_memory_utilization, self.kv_cache_dtype),
            attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling, faults=FaultPlan.parse(self.inject_faults),
            kernels=envs.kernel_config(), observability=envs.observability_config(),
            speculative=spec, tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            data_parallel_size=self.data_parallel_size, kv_tiers=self._kv_tiers(spec, model_cfg),
            lora=self._lora_config(), pooler=pooler, batch_invariant=self.batch_invariant,
        )
        return config, source, model_cfg

    def _kv_tiers(self, spec: SpeculativeConfig | None, model_cfg: ModelConfig) -> KVTierConfig:
        """The KV tiers' settings, checked against the rest (ValueError names the fix)."""
        tiers = KVTierConfig(int(self.kv_offload_size * 2**30), self.kv_cache_dir,
                             int(self.kv_cache_dir_size * 2**30))
        if not tiers.enabled:
            return tiers
        if not self.enable_prefix_caching:
            raise ValueError("the KV tiers (--kv-offload-size, --kv-cache-dir) keep prefix-cached "
                             "blocks: drop --no-enable-prefix-caching")
        if model_cfg.sliding_windows and None not in model_cfg.sliding_windows:
            raise ValueError("the KV tiers (--kv-offload-size, --kv-cache-dir) do not serve models "
                             "whose every layer slides (their blocks before the window go back "
                             "outside the prefix cache): drop the flags")
        if spec is not None and spec.method == "draft_model":
            raise ValueError("the KV tiers do not move a draft model's KV cache yet: use the "
                             "ngram method or drop --kv-offload-size / --kv-cache-dir")
        if tiers.cache_dir is not None and self.tensor_parallel_size > 1:
            raise ValueError("--kv-cache-dir does not work with tensor parallelism yet: drop it "
                             "(the host tier, --kv-offload-size, does)")
        return tiers

    def _check_batch_invariant(self, quantization: str | None) -> None:
        """ValueError where --batch-invariant cannot keep its promise yet: its fixed-order
        paths cover the unquantized weight products and attention of one process only."""
        if not self.batch_invariant:
            return
        other = ([f"--quantization {quantization}"] if quantization else []) + \
            (["--enable-lora"] if self.enable_lora else []) + \
            (["--tensor-parallel-size > 1"] if self.tensor_parallel_size > 1 else [])
        if other:
            raise ValueError(f"--batch-invariant does not cover {', '.join(other)} yet (their "
                             "products are not in fixed row order): drop one of them")

    def _lora_config(self) -> LoRAConfig | None:
        """The adapters' limits with enable_lora, else None; ValueError for what LoRA does not
        compose with yet."""
        if not self.enable_lora:
            return None
        if self.tensor_parallel_size != 1:
            raise ValueError("--enable-lora does not support --tensor-parallel-size > 1 yet")
        if self.speculative_config is not None:
            raise ValueError("--enable-lora does not support speculative decoding yet")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)


def engine_args(model: str | None = None, **kwargs: Any) -> EngineArgs:
    """`EngineArgs(model, **kwargs)` with a TypeError naming an unknown setting (for `LLM`)."""
    names = {f.name for f in fields(EngineArgs)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"unknown engine setting(s) {unknown}: the settings are the fields of "
                        f"pagedserve.engine_args.EngineArgs ({', '.join(sorted(names))})")
    return EngineArgs(model, **kwargs)


EXECUTOR_BACKENDS = ("mp", "uni")


def check_tensor_parallel(size: int, model_cfg: ModelConfig, quantization: str | None,
                          quant_config: dict[str, Any] | None, backend: str | None = None) -> None:
    """ValueError where `size` ranks (or the executor `backend` asked for) cannot run this
    model with this quantization method (`quant_config`: a pre-quantized checkpoint's)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a whole number >= 1, got {size!r}")
    if backend == "ray":
        raise ValueError("distributed_executor_backend 'ray' is not supported: tensor parallelism "
                         "runs on the GPUs of one host ('mp'); for replicas on many hosts, use "
                         "`pagedserve serve-ray`")
    if backend not in (None, *EXECUTOR_BACKENDS):
        raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}")
    if backend == "uni" and size > 1:
        raise ValueError(f"distributed_executor_backend 'uni' runs one in-process worker; "
                         f"tensor_parallel_size {size} needs 'mp' (the default for it)")
    if size == 1 and backend != "mp":
        return
    check_config_split(model_cfg, size)
    check_quantized_split(model_cfg, size, split_units(quantization, quant_config))


def check_data_parallel(size: int, device: str) -> None:
    """ValueError where `size` engine cores cannot be placed on `device` (the GPU count is
    checked by each core when it starts: `engine/devices.py`)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"data_parallel_size must be a whole number >= 1, got {size!r}")
    if size > 1 and device.startswith("cuda:"):
        raise ValueError(f"--device {device} names one GPU, but --data-parallel-size {size} runs "
                         f"an engine core per GPU (core i on GPUs i x tensor_parallel_size and "
                         "up): give --device cuda or auto, and choose the GPUs with "
                         "CUDA_VISIBLE_DEVICES")


def _checked_draft(spec: SpeculativeConfig, model_cfg: ModelConfig, load_format: str,
                   tp_size: int) -> SpeculativeConfig:
    """The draft model resolved (a Hub id: its local folder), its vocabulary checked, and its
    split over `tp_size` tensor-parallel ranks (each rank runs its share of the draft)."""
    try:
        source = resolve_model(spec.model, load_format=load_format)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative config: draft model {spec.model!r}: {e}") from None
    if source.is_preset and load_format != "dummy":
        raise ValueError(f"speculative config: draft model preset {spec.model!r} ships no weights "
                         "(with --load-format dummy both models get random weights)")
    draft_cfg = model_config_from_hf(source.hf_config)
    vocab = draft_cfg.vocab_size
    if vocab != model_cfg.vocab_size:
        raise ValueError(f"speculative config: draft model {spec.model!r} has a vocabulary of {vocab} "
                         f"tokens and the model {model_cfg.vocab_size}: they must be the same")
    if isinstance(tp_size, int) and tp_size > 1:
        try:
            check_config_split(draft_cfg, tp_size)
        except ValueError as e:
            raise ValueError(f"speculative config: draft model {spec.model!r} splits over the "
                             f"tensor-parallel ranks as the model does: {e}") from None
    return replace(spec, model=str(source.folder)) if source.from_hub else spec
