"""Rules of the code's shape, checked on the source: no import circles between pagedserve's
modules (imports inside functions count), imports that run down the layers (the few that run
up are listed with their reasons), no module over 400 lines, no environment read outside
envs.py, and nothing outside attention/ reaching into an attention backend's own module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedserve"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path, module: str) -> set[str]:
    """pagedserve modules `module` imports anywhere in the file: at module level, inside
    functions and under `if TYPE_CHECKING:` alike (a lazy import is still a dependency).
    `from pkg import name` is an import of the module `pkg.name` where that is a module, else
    of `pkg` itself."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # (relative imports: resolve against the package)
                pkg = module.split(".")[: -node.level if path.name != "__init__.py" else None]
                base = ".".join([*pkg, node.module])
            subs = [f"{base}.{a.name}" for a in node.names]
            names = [s for s in subs if s in MODULES] or [base]
        found |= {n for n in names if n in MODULES and n != module}
    return found


GRAPH = {m: _imports(p, m) for m, p in MODULES.items()}


def test_no_import_circles():
    """No cycle in the import graph, counting imports inside functions and under
    TYPE_CHECKING (a package importing its own submodules is no cycle)."""
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for dep in sorted(GRAPH[m]):
            if dep.startswith(m + "."):
                continue
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = "done"

    for m in GRAPH:
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


# The layers, lowest first: a module may import its own layer's modules and lower ones. A
# module belongs to the longest prefix that names it.
LAYERS = [
    # plain data and process utilities: what a request asks for, the configs, small helpers
    ["pagedserve.config", "pagedserve.faults", "pagedserve.sampling_params", "pagedserve.outputs",
     "pagedserve.structured.params", "pagedserve.structured.bad_words_automaton",
     "pagedserve.spec_decode.config", "pagedserve.models.moe_config", "pagedserve.models.rope_scaling",
     "pagedserve.distributed.split", "pagedserve.unicode_checks", "pagedserve.heap",
     "pagedserve.ipc_dirs", "pagedserve.lifeline", "pagedserve.child_process", "pagedserve.host_copy",
     "pagedserve.version", "pagedserve.lora.request", "pagedserve.lora.config",
     "pagedserve.lora.peft_checkpoint", "pagedserve.lora.slots", "pagedserve.lora.known"],
    ["pagedserve.envs", "pagedserve.tokenizer"],  # the environment's switches; text <-> ids
    ["pagedserve.kernels", "pagedserve.distributed"],  # Triton kernels; tensor-parallel groups
    ["pagedserve.attention"],
    ["pagedserve.layers"],
    ["pagedserve.quantization"],  # LinearMethods over layers/linear_method.py
    ["pagedserve.models"],
    ["pagedserve.lora"],  # LoRA adapters' slot tensors and their per-row term (torch)
    ["pagedserve.structured"],
    # the engine's state: requests, scheduling, KV blocks, step buffers, messages
    ["pagedserve.engine.request", "pagedserve.engine.cached_request", "pagedserve.engine.scheduler",
     "pagedserve.engine.kv_cache_manager", "pagedserve.engine.kv_cache_spec", "pagedserve.engine.cache_sizing",
     "pagedserve.engine.input_batch", "pagedserve.engine.block_tables", "pagedserve.engine.graphs",
     "pagedserve.engine.messages",
     "pagedserve.engine.limits", "pagedserve.engine.stopping", "pagedserve.engine.step_timer",
     "pagedserve.engine.step_trace", "pagedserve.engine.step_handle", "pagedserve.engine.heartbeat",
     "pagedserve.engine.prompt_logprobs", "pagedserve.engine.kv_tiers",
     "pagedserve.engine.kv_tier_prefix"],
    ["pagedserve.spec_decode"],  # proposers and verification, over the engine's state
    ["pagedserve.engine"],  # the assembly: runner, worker, executors, core, core process
    ["pagedserve.engine_args", "pagedserve.llm"],
    ["pagedserve.server", "pagedserve.monitor", "pagedserve.baseline"],
    ["pagedserve.bench", "pagedserve.replicas", "pagedserve.ui", "pagedserve.cli", "pagedserve"],
]

# Imports that run up the layers, each with its reason (at most 7 may exist).
UPWARD = {
}


def _layer(module: str) -> int:
    best = max(((len(prefix), i) for i, group in enumerate(LAYERS) for prefix in group
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def test_imports_run_down_the_layers():
    upward = {(a, b) for a, deps in GRAPH.items() for b in deps
              if not b.startswith(a + ".") and _layer(b) > _layer(a)}
    assert upward == set(UPWARD), sorted(upward ^ set(UPWARD))
    assert len(UPWARD) <= 7


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_400_lines(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= 400, f"{MODULES[module]} has {lines} lines"


def test_only_envs_reads_the_environment():
    offenders = []
    for module, path in MODULES.items():
        if module == "pagedserve.envs":
            continue
        text = path.read_text()
        if "os.environ" in text or "getenv(" in text:
            offenders.append(str(path))
    assert not offenders


def test_only_attention_imports_a_backend_module():
    """Engine code speaks to backends through attention/backend.py's interface; a backend's
    own module (its kernels' bookkeeping) is imported only inside attention/ (and by the
    registry in attention/__init__)."""
    backends = {"pagedserve.attention.triton_backend", "pagedserve.attention.torch_ref"}
    offenders = [m for m, p in MODULES.items() if not m.startswith("pagedserve.attention")
                 and _imports(p, m) & backends]
    assert not offenders
