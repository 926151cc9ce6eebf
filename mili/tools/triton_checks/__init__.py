"""The Triton kernels compiled ahead of time for NVIDIA targets without a GPU (CI's compile check)."""
