"""A quantized checkpoint's layers as it stores them, on the Triton GEMMs (CUDA; the Triton back-end under
TRITON_INTERPRET): Qwen's FP8 blocks (``gpu_linear.BlockFp8Linear``), compressed-tensors' FP8 channels
(``cpu_linear.Fp8Linear`` on torch._scaled_mm where activations go FP8, else the block GEMM), AWQ's int4 groups
(``gpu_linear.AwqLinear``). A layer the kernels can't take keeps its dequantized weights, as do MoE experts.
(``gpu_linear.quantized_layer`` picks each layer's.)"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from mili.model.cpu_linear import swap_linears
from mili.model.formats.base import LinearFormat


@dataclass(frozen=True)
class Triton(LinearFormat):
    fp8_activations: bool = False  # the FP8 GEMMs take FP8 activations (W8A8: SM 89+ in a 16-bit model)
    group_size: int = 0  # AWQ's input channels per zero point and scale (0: an FP8 checkpoint)

    name = "triton"
    summary = "a quantized checkpoint's layers as stored, on the Triton FP8 and int4 GEMMs"
    gemm_kinds = (("fp8", 1), ("int4", 0.5))

    def bytes_per_weight(self, dtype):
        if self.group_size:  # 4-bit q, a uint8 zero point and an fp16 scale per group
            return 0.5 + 3 / self.group_size
        return 1.0  # (a float32 scale per 128 x 128 block or per row of thousands: under 0.001)

    def apply(self, model, quantized, skip_head):
        from mili.model.gpu_linear import quantized_layer  # (triton's import: only where its GEMMs run)

        swap_linears(model, None, quantized, make_quantized=partial(quantized_layer,
                                                                    fp8_activations=self.fp8_activations),
                     skip_head=skip_head)
