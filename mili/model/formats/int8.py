"""--quantization int8 (and fp8 where no FP8 GEMM runs, through FP8 and back first): int8 weights with one scale per
output channel, quantized as they load, on the CPU (``int8``: MILI's W8A8 kernel, or aten's weight-only
``_weight_int8pack_mm``; ``cpu_linear.Int8Linear``) or on the Triton int8 GEMM (``triton-int8``: CUDA SM 8.0+, the
Triton back-end under TRITON_INTERPRET; ``gpu_linear.TritonInt8Linear``). A tied lm_head gets its own int8 copy
(half the bytes the head reads); the embedding keeps its table."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from mili.model.cpu_linear import Int8Linear, int8_head, swap_linears
from mili.model.formats.base import LinearFormat


@dataclass(frozen=True)
class Int8(LinearFormat):
    kernels: bool = False  # on MILI's W8A8 kernel (activations per row too), else aten's weight-only int8

    name = "int8"
    summary = "int8 per output channel on the CPU (MILI's W8A8 kernel, or aten's weight-only int8)"

    @property
    def fused_decode(self):
        return self.kernels

    def bytes_per_weight(self, dtype):
        return 1.0

    def apply(self, model, quantized, skip_head):
        swap_linears(model, partial(Int8Linear, kernels=self.kernels), skip_head=skip_head)
        if model.lm_head is None and not skip_head:
            int8_head(model, self.kernels)

    def apply_head(self, model):
        int8_head(model, self.kernels)

    def describe_head(self, dtype):
        return "int8" + (" (W8A8 kernel)" if self.kernels else "")


@dataclass(frozen=True)
class TritonInt8(LinearFormat):
    name = "triton-int8"
    summary = "int8 per output channel on the Triton int8 GEMM (weight-only)"
    gemm_kinds = (("int8", 1),)

    def bytes_per_weight(self, dtype):
        return 1.0

    def apply(self, model, quantized, skip_head):
        from mili.model.gpu_linear import TritonInt8Linear  # (triton's import: only where its GEMMs run)

        swap_linears(model, TritonInt8Linear, skip_head=skip_head)
        if model.lm_head is None and not skip_head:  # (its own int8 copy of a tied table, on the GEMM too)
            model.lm_head = TritonInt8Linear(model.model.embed_tokens.weight)
