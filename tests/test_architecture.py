"""Rules of the code's shape, checked on the source: no import circles between pagedserve's
modules, no module over 400 lines, no environment read outside envs.py, and nothing outside
attention/ reaching into an attention backend's own module."""

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


def _imports(path: Path, module: str, everywhere: bool) -> set[str]:
    """pagedserve modules `module` imports: at module level only (what runs on import), or
    anywhere in the file."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if everywhere else _top_level(tree.body)
    found = set()
    for node in nodes:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # (relative imports: resolve against the package)
                pkg = module.split(".")[: -node.level if path.name != "__init__.py" else None]
                base = ".".join([*pkg, node.module])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        found |= {n for n in names if n in MODULES and n != module}
    return found


def _top_level(body):
    """Statements that run on import: the body, through if/try blocks, but not under
    `if TYPE_CHECKING:` and not inside functions or classes' methods."""
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from _top_level(node.body)
            yield from _top_level(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def test_no_import_circles():
    """Module-level imports form no cycle (a lazy import inside a function does not count
    as an edge, but a pair of modules importing each other at module level does)."""
    graph = {m: _imports(p, m, everywhere=False) for m, p in MODULES.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    # a package importing its own submodules (pagedserve/__init__ -> pagedserve.llm) is no cycle
    cycles = [c for c in cycles if not any(a.startswith(b + ".") for a, b in zip(c[1:], c))]
    assert not cycles, cycles


def test_engine_and_graph_modules_do_not_import_each_other_lazily_either():
    """The two circles issue 23 named: the core and the warm-up, the runner and the graphs; and
    issue 56's executor pair (the core picks the executor, so neither needs the other's kind)."""
    for a, b in (("pagedserve.engine.core", "pagedserve.engine.warm_up"),
                 ("pagedserve.engine.model_runner", "pagedserve.engine.graphs"),
                 ("pagedserve.engine.executor", "pagedserve.engine.tp_executor")):
        both = (b in _imports(MODULES[a], a, everywhere=True), a in _imports(MODULES[b], b, everywhere=True))
        assert both != (True, True), (a, b)


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
                 and _imports(p, m, everywhere=True) & backends]
    assert not offenders
