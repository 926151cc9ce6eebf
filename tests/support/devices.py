"""Where the Triton kernel tests run: compiled on a GPU with MILI_TEST_GPU=1, else on the CPU under TRITON_INTERPRET=1
(tests/conftest.py sets it before anything imports triton)."""

from __future__ import annotations

import os

import torch

TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def kernel_isas() -> list[str]:
    """The ISA paths of MILI's CPU kernels a test taking each path runs over: every one this machine executes (AVX2
    tested on an AVX-512 machine too), or under MILI_CPU_ISA (a run held to one path, as tests/e2e/test_cpu_isa.py's
    lower-path runs are) that path alone (none: no kernel path), so a held run doesn't repeat the default run's
    other paths."""
    from mili.kernels import cpu

    held = cpu.requested()
    return [name for name in cpu.runnable_isas() if name != "none" and held in (None, name)]
