"""tests/support/triton_interpreter.py (the suite's faster listing of tl's builtins under TRITON_INTERPRET) wraps
exactly what Triton's own ``_patch_builtin`` wraps, in a fresh state and inside a running kernel, and a kernel
calling a ``@triton.jit`` helper still computes under it."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # (MILI_TEST_GPU=1: the kernels run compiled, no interpreter)
    pytest.skip("about Triton's interpreter: TRITON_INTERPRET is not 1", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from support.triton_interpreter import install  # noqa: E402


def _wrapped(patch, pkg) -> tuple[list[str], interpreter._LangPatchScope]:
    scope = interpreter._LangPatchScope()
    patch(pkg, interpreter.interpreter_builder, scope)
    return [name for _, name, _ in scope._changes], scope


def test_the_memoized_listing_wraps_what_tritons_own_wraps():
    assert install()
    memoized = interpreter._patch_builtin
    original = memoized.original
    for pkg in (tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        theirs, scope = _wrapped(original, pkg)
        scope.restore()
        ours, scope = _wrapped(memoized, pkg)
        assert ours == theirs and len(ours) > 3, pkg
        # (inside a launch, everything is wrapped already: neither wraps anything again)
        assert _wrapped(original, pkg)[0] == [] and _wrapped(memoized, pkg)[0] == []
        scope.restore()
        again, scope = _wrapped(memoized, pkg)  # (restored: builtins again, wrapped again)
        scope.restore()
        assert again == theirs


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helper_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _twice(tl.load(X + offs)) + 1)


def test_a_kernel_with_a_helper_computes_under_it():
    assert install()
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty_like(x)
    for _ in range(2):  # (the second launch: the listing is the memoized one)
        _helper_kernel[(1,)](x, y, 16)
        assert torch.equal(y, x * 2 + 1)
