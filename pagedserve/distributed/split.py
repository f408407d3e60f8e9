"""How a model's dimensions divide among tensor-parallel ranks (torch-free: the HTTP process
checks `--tensor-parallel-size` before any engine starts)."""

from __future__ import annotations

from typing import NamedTuple


def share(n: int, size: int, what: str) -> int:
    """n / size: one rank's share of n (ValueError naming `what` if it does not divide)."""
    if n % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs {what} ({n}) to be a "
                         f"multiple of {size}")
    return n // size


def check_model_split(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                      size: int, moe_intermediate_size: int | None = None) -> None:
    """ValueError naming every model dimension `size` ranks cannot share evenly (with a
    mixture of experts, each expert's intermediate size too)."""
    problems = []
    dims = [(num_heads, "the attention heads"), (num_kv_heads, "the KV heads"),
            (intermediate_size, "the MLP's intermediate size"), (vocab_size, "the vocabulary")]
    if moe_intermediate_size is not None:
        dims.append((moe_intermediate_size, "the experts' intermediate size (moe_intermediate_size)"))
    for n, what in dims:
        try:
            share(n, size, what)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("; ".join(problems))


def check_config_split(cfg, size: int) -> None:
    """`check_model_split` for a `ModelConfig` (its heads, KV heads, MLP, vocabulary, experts)."""
    check_model_split(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size, size,
                      cfg.moe.intermediate_size if cfg.moe is not None else None)


class SplitUnits(NamedTuple):
    """What a weight format needs of each rank's share: every column-parallel output (each
    shard of a fused projection) a multiple of `outputs`, every row-parallel input a multiple
    of `inputs`; `why` says what would be cut otherwise."""

    outputs: int = 1
    inputs: int = 1
    why: str = ""


def check_quantized_split(cfg, size: int, units: SplitUnits) -> None:
    """ValueError naming every projection of a `ModelConfig` whose share for one of `size`
    ranks a weight format (`units`, from `quantization.split_units`) cannot hold."""
    if size == 1:
        return
    problems = []
    column = [("q_proj", cfg.q_size), ("k_proj and v_proj", cfg.kv_size),
              ("gate_proj and up_proj", cfg.intermediate_size)]
    row = [("o_proj", cfg.q_size), ("down_proj", cfg.intermediate_size)]
    moe = getattr(cfg, "moe", None)
    if moe is not None:  # each expert's share of its intermediate features
        column.append(("the experts' gate_proj and up_proj", moe.intermediate_size))
        row.append(("the experts' down_proj", moe.intermediate_size))
    for dims, unit, part in ((column, units.outputs, "outputs"), (row, units.inputs, "inputs")):
        for name, n in dims:
            if (n // size) % unit:
                problems.append(f"{name}: {n} {part}, {n // size} a rank, not a multiple of {unit}")
    if problems:
        raise ValueError(f"the checkpoint's weights do not split over {size} tensor-parallel ranks: "
                         f"{'; '.join(problems)} ({units.why}); use a tensor-parallel size that "
                         "leaves each rank whole units, or serve the model on one rank")
