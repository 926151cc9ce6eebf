"""flash-linear-attention's Triton kernels under TRITON_INTERPRET=1 on the CPU, for the tests (fla-core 0.6.0).

Two things stop them there, neither in the kernels' math:

* fla's autotuned kernels benchmark their configs on first launch, through the active Triton driver, which
  the interpreter does not have ("RuntimeError: 0 active drivers ([]). There should only be one."): the
  benchmark is replaced by a constant, so the first config runs (there is no timing to pick by anyway);
* some kernels call ``.to(tl.int64)`` on a ``range`` loop variable (``chunk_delta_h.py``: ``i_t.to(tl.int64)``),
  which compiled Triton makes a tensor but the interpreter leaves a Python int ("AttributeError: 'int'
  object has no attribute 'to'"): ``range`` in fla's op modules yields ints that also have ``.to``.

``fused_recurrent_gated_delta_rule`` needs neither; ``chunk_gated_delta_rule`` needs both. Call ``enable()``
after TRITON_INTERPRET=1 is set and before fla's kernels run; it imports fla."""

from __future__ import annotations

import builtins
import os
import sys


class _LoopIndex(int):
    def to(self, dtype, *args, **kwargs):
        from triton.runtime import interpreter

        return interpreter.interpreter_semantic.to_tensor(int(self), False).to(dtype)


def _range(*args):
    return (_LoopIndex(i) for i in builtins.range(*args))


def enable() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "for the Triton interpreter only"
    from triton.runtime import autotuner

    import fla.ops.gated_delta_rule  # noqa: F401  (imports the op modules patched below)

    # reach-in: Triton's autotuner benchmarks each config by timing it, which the interpreter cannot: no timing
    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [0.0, 0.0, 0.0]
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops") and module is not None:
            module.range = _range
