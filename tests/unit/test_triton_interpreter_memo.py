"""tests/support/triton_interpreter.py (the suite's faster listing of tl's builtins under TRITON_INTERPRET) wraps
exactly what Triton's own listing wraps, in a fresh state and inside a running kernel, and a kernel calling a
``@triton.jit`` helper still computes under it."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # (MILI_TEST_GPU=1: the kernels run compiled, no interpreter)
    pytest.skip("about Triton's interpreter: TRITON_INTERPRET is not 1", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.language.core import tensor_descriptor_base  # noqa: E402
from triton.runtime.interpreter import interpreter_builder  # noqa: E402

from support.triton_interpreter import install  # noqa: E402


class Scope:
    """What the listing is given to patch through (Triton's scope's one method): records each name it wraps, and
    puts the members back on restore()."""

    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def restore(self):
        while self.changes:
            obj, name, value = self.changes.pop()
            setattr(obj, name, value)


def _wrapped(listing, pkg) -> tuple[list[str], Scope]:
    scope = Scope()
    listing(pkg, interpreter_builder, scope)
    return [name for _, name, _ in scope.changes], scope


def test_the_memoized_listing_wraps_what_tritons_own_wraps():
    memo = install()
    assert memo is not None and memo.original is not memo
    for pkg in (tl, tl.tensor, tl.math, tensor_descriptor_base):
        theirs, scope = _wrapped(memo.original, pkg)
        scope.restore()
        ours, scope = _wrapped(memo, pkg)
        assert ours == theirs and len(ours) > 3, pkg
        # (inside a launch, everything is wrapped already: neither wraps anything again)
        assert _wrapped(memo.original, pkg)[0] == [] and _wrapped(memo, pkg)[0] == []
        scope.restore()
        again, scope = _wrapped(memo, pkg)  # (restored: builtins again, wrapped again)
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
    assert install() is not None
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty_like(x)
    for _ in range(2):  # (the second launch: the listing is the memoized one)
        _helper_kernel[(1,)](x, y, 16)
        assert torch.equal(y, x * 2 + 1)
