"""Triton's interpreter (TRITON_INTERPRET=1), the same semantics at less cost for the suite's Triton-path tests.

At every kernel launch, and again at every call of a ``@triton.jit`` helper inside a kernel (for each program of
the grid), the interpreter re-patches ``triton.language`` by listing the members of ``tl``, ``tl.tensor``,
``tl.math`` and ``tl.core.tensor_descriptor_base`` with ``inspect.getmembers`` and wrapping those that are Triton
builtins. The listing is the cost: measured under cProfile, 26 of the 62 s a float32 mixed-step run of the tiny
checkpoint took (tests/unit/test_cuda_only_paths.py), for lists that never change.

``install()`` replaces the interpreter's ``_patch_builtin(pkg, builder, scope)`` with one that lists each package's
builtin names once (on the first call, made by a kernel launch before anything is patched) and then, as the
original does, wraps each name whose current member is a builtin: members already wrapped (a helper's call inside a
running kernel) are skipped, as the original skips them (all at once: a package's builtins are wrapped together by
one launch and restored together when it ends, so its first name tells). A Triton whose interpreter has no such
function is left as it is. Tests only: MILI itself never runs the interpreter.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

_MEMO: Callable | None = None  # the installed listing (its .original: Triton's own)


def _memoized(original: Callable, patch_attr: Callable) -> Callable:
    """``original`` (Triton's listing) memoized, or ``original`` itself where it is not of the known shape."""
    global _MEMO
    from triton.language.core import is_builtin

    if getattr(original, "original", None) is not None:
        return original  # (installed already)
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return original
    names: dict[object, list[str]] = {}

    def memo(pkg, builder, scope):
        if pkg not in names:
            names[pkg] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        listed = names[pkg]
        if listed and not is_builtin(getattr(pkg, listed[0])):
            return  # (wrapped already: a package's builtins are wrapped together, and restored together)
        for name in listed:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    memo.original = original
    _MEMO = memo
    return memo


def install() -> Callable | None:
    """Memoize the interpreter's listing of tl's builtins: the installed listing (``.original``: Triton's own, which
    takes the same arguments), or None where this Triton's interpreter was left alone."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    try:
        # reach-in: the interpreter re-lists tl's builtins at every call (above), through this private function
        interpreter._patch_builtin = _memoized(interpreter._patch_builtin, interpreter._patch_attr)
    except AttributeError:  # (another Triton's interpreter)
        return None
    return _MEMO
