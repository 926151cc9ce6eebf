"""What a Triton launch may use on a device: its SM version, the shared memory one block may have, its SM
count; and the GEMMs' tile and stage choice as a pure function of (rows, dtypes, device).

The wrappers in this package ask ``device_spec(tensor.device)`` and pick their launch configuration from it,
and the compile check (``compile_check.py``) calls the same functions with ``TARGETS``' specs, so every
configuration the runner can pick for a target is one that was compiled for it. ``check_device`` refuses,
at start-up, a GPU the kernels cannot run on.

Shared memory one block may opt in to (CUDA C Programming Guide, "Technical Specifications per Compute
Capability"; ``cudaDevAttrMaxSharedMemoryPerBlockOptin``): SM 8.0 163 KiB, 8.6 / 8.9 / 12.x 99 KiB, 8.7 163 KiB,
9.0 / 10.0 227 KiB.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mili.errors import InvalidRequest

KIB = 1024
_SMEM_OPTIN = {(8, 0): 163 * KIB, (8, 6): 99 * KIB, (8, 7): 163 * KIB, (8, 9): 99 * KIB, (9, 0): 227 * KIB,
               (10, 0): 227 * KIB, (12, 0): 99 * KIB}


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    capability: tuple[int, int]
    smem_per_block: int  # bytes of shared memory one block may opt in to
    num_sms: int

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def has_fp8(self) -> bool:
        return self.capability >= (8, 9)


TARGETS = {
    "sm_80": DeviceSpec("A100", (8, 0), _SMEM_OPTIN[(8, 0)], 108),
    "sm_89": DeviceSpec("L4 / RTX 4090 / RTX 6000 Ada", (8, 9), _SMEM_OPTIN[(8, 9)], 58),
    "sm_90": DeviceSpec("H100 / H200", (9, 0), _SMEM_OPTIN[(9, 0)], 132),
}
INTERPRETER = TARGETS["sm_90"]  # the CPU under TRITON_INTERPRET picks what an H100 picks


@functools.lru_cache(maxsize=None)
def _cuda_spec(index: int) -> DeviceSpec:
    p = torch.cuda.get_device_properties(index)
    cap = (p.major, p.minor)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or _SMEM_OPTIN.get(cap, 99 * KIB)
    return DeviceSpec(p.name, cap, int(smem), p.multi_processor_count)


def device_spec(device: torch.device | str) -> DeviceSpec:
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER
    return _cuda_spec(device.index if device.index is not None else torch.cuda.current_device())


# -- the quantized GEMMs' tiles ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def gemm_smem_bound(block_m: int, block_n: int, block_k: int, a_bytes: int, w_bytes_per_k: float,
                    stages: int) -> int:
    """An upper bound of the shared memory of one GEMM program: ``stages`` buffers of the A and W tiles
    (W's bytes per element along K: 1 for FP8, 0.5 for int4) and one layout-conversion scratch (the
    dequantized W tile, or the float32 accumulator at the store). The compile check holds every compiled
    configuration to it, so the choice below is safe on devices that were not compiled for."""
    per_stage = block_m * block_k * a_bytes + int(block_k * block_n * w_bytes_per_k)
    return stages * per_stage + max(block_m * block_n * 4, block_k * block_n * a_bytes)


def gemm_config(m: int, block_k: int, a_bytes: int, w_bytes_per_k: float, exact: bool,
                spec: DeviceSpec) -> GemmConfig:
    """(BLOCK_M, BLOCK_N, warps, stages) for M rows: narrow tiles for decode, wider for prefill, the first
    that fits the device's shared memory (fewer stages before a smaller tile). ``exact`` (float32 models:
    IEEE dots on the CUDA cores, which hold their operands in registers) keeps to the smallest tile."""
    if exact or m <= 16:
        tiles = [(16, 64)]
    else:
        tiles = [(32, 64), (16, 64)] if m <= 32 else [(64, 128), (32, 64), (16, 64)]
    for bm, bn in tiles:
        for stages in (3, 2):
            if gemm_smem_bound(bm, bn, block_k, a_bytes, w_bytes_per_k, stages) <= spec.smem_per_block:
                return GemmConfig(bm, bn, 8 if bm * bn >= 64 * 128 else 4, stages)
    raise InvalidRequest(f"no tile of the quantized GEMM fits {spec.name}'s {spec.smem_per_block} bytes of shared "
                         f"memory per block", param="device")


# -- start-up ---------------------------------------------------------------------------------------------
MIN_CAPABILITY = (8, 0)  # bf16 tensor-core dots (tl.dot on bfloat16) and cp.async pipelining


def check_device(spec: DeviceSpec, dtype: torch.dtype, kv_fp8: bool = False) -> None:
    """Refuse, before anything is launched, a GPU the Triton kernels cannot run on. (FP8 KV pages on a GPU without
    FP8 are the plan's to refuse, mili/runtime/plan.py's ``_kv_dtype``, which runs first; ``kv_fp8`` is not read
    here.)"""
    if spec.capability < MIN_CAPABILITY:
        raise InvalidRequest(
            f"{spec.name} (compute capability {spec.capability[0]}.{spec.capability[1]}) cannot run MILI's Triton "
            f"kernels, which need SM 8.0 or later (A100, L4/RTX 4090, H100): use --attention-backend torch",
            param="attention_backend")
    for a_bytes, w_bytes in ((1, 1), (2, 1), (2, 0.5), (4, 1), (4, 0.5)):  # every GEMM kind has a tile that fits
        gemm_config(1, 128, a_bytes, w_bytes, a_bytes == 4, spec)
