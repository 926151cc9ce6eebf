"""Where the Triton kernel tests run: compiled on a GPU with MILI_TEST_GPU=1, else on the CPU under TRITON_INTERPRET=1
(tests/conftest.py sets it before anything imports triton)."""

from __future__ import annotations

import os

import torch

TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
