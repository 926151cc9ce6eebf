"""--quantization fp8 on GPUs with FP8 (SM 89+): FP8 e4m3 weights with one scale per output channel, activations
quantized per token, on torch._scaled_mm (``cpu_linear.Fp8Linear``); the lm_head stays in the model's dtype.
(Elsewhere --quantization fp8 runs the int8 formats on the weights' FP8 values.)"""

from __future__ import annotations

from dataclasses import dataclass

from mili.model.cpu_linear import Fp8Linear, swap_linears
from mili.model.formats.base import LinearFormat


@dataclass(frozen=True)
class Fp8(LinearFormat):
    name = "fp8"
    summary = "fp8 e4m3 per output channel on torch._scaled_mm (W8A8, activations per token)"

    def bytes_per_weight(self, dtype):
        return 1.0

    def apply(self, model, quantized, skip_head):
        swap_linears(model, Fp8Linear, skip_head=True)  # (the lm_head aside)
