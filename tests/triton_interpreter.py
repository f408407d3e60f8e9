"""A faster Triton interpreter for the kernel tests (the suite's CPU time, not what they check).

Triton's interpreter re-patches `triton.language` on every call of a jit function from inside
a kernel (`tl.max`, `tl.rand4x`, our own helpers): each time it lists every member of four
modules with `inspect.getmembers` to find the builtins to wrap, about a quarter of a kernel
test's CPU time (profiled on the fused sampling kernel, Triton 3.9). The builtins of a module
are the same every time, so `_patch_builtin` here looks them up once, by name, before any
kernel ran (the interpreter leaves some wrapped and swaps others out while a kernel runs), and
then wraps those of them still unwrapped, as the original does: the kernels run the same
operations.
"""

from __future__ import annotations

import inspect


def speed_up_interpreter() -> bool:
    """Install the remembering `_patch_builtin` (once, before the first kernel runs); False
    where this Triton's interpreter has another shape (then it is left as it is)."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    original = getattr(interp, "_patch_builtin", None)
    if getattr(original, "remembers_names", False):
        return True
    if (original is None or not hasattr(interp, "_patch_attr")
            or list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]):
        return False
    names: dict[int, list[str]] = {}  # id(module or class) -> names of its builtins

    def builtin_names(pkg) -> list[str]:
        return [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]

    # (before any kernel: what _patch_lang passes, unwrapped)
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        names[id(pkg)] = builtin_names(pkg)

    def _patch_builtin(pkg, builder, scope) -> None:
        known = names.get(id(pkg))
        if known is None:  # (no other package reaches here in this Triton: as the original)
            known = names[id(pkg)] = builtin_names(pkg)
        for name in known:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):  # (a wrapped one is no builtin: left as it is)
                interp._patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.remembers_names = True
    _patch_builtin.original = original
    interp._patch_builtin = _patch_builtin
    return True
