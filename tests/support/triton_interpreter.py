"""Triton's interpreter (TRITON_INTERPRET=1), the same semantics at less cost for the suite's Triton-path tests.

At every kernel launch, and again at every call of a ``@triton.jit`` helper inside a kernel (for each program of
the grid), the interpreter re-patches ``triton.language`` by listing the members of ``tl``, ``tl.tensor``,
``tl.math`` and ``tl.core.tensor_descriptor_base`` with ``inspect.getmembers`` and wrapping those that are Triton
builtins. The listing is the cost: measured under cProfile, 26 of the 62 s a float32 mixed-step run of the tiny
checkpoint took (tests/unit/test_cuda_only_paths.py), for lists that never change.

``install()`` replaces ``triton.runtime.interpreter._patch_builtin`` with one that lists each package's builtin
names once (on the first call, made by a kernel launch before anything is patched) and then, as the original does,
wraps each name whose current member is a builtin: members already wrapped (a helper's call inside a running
kernel) are skipped, as the original skips them (all at once: a package's builtins are wrapped together by one
launch and restored together when it ends, so its first name tells). Only a ``_patch_builtin(pkg, builder, scope)`` of that shape is
replaced; another Triton's interpreter is left as it is. Tests only: MILI itself never runs the interpreter.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Memoize the interpreter's builtin listing; True if installed (or already), False if left alone."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    if getattr(original, "memoized", False):
        return True
    if original is None or not hasattr(interpreter, "_patch_attr") or \
            list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return False
    names: dict[object, list[str]] = {}

    def _patch_builtin(pkg, builder, scope):
        if pkg not in names:
            names[pkg] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        listed = names[pkg]
        if listed and not tl.core.is_builtin(getattr(pkg, listed[0])):
            return  # (wrapped already: a package's builtins are wrapped together, and restored together)
        for name in listed:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.memoized, _patch_builtin.original = True, original
    interpreter._patch_builtin = _patch_builtin
    return True
