"""Triton kernels (import only where triton is installed: CUDA, or the CPU under TRITON_INTERPRET=1)."""
