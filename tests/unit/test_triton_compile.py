"""Every Triton kernel compiled ahead of time for real NVIDIA targets (sm_80, sm_89, sm_90) on this CPU, at the
configurations the runner launches (``mili/tools/triton_checks/compile_check.py``): it compiles, fits the target's
shared memory per block, and spills no more than its stated bound. The default run keeps one launch per
kernel, phase and FP8-ness per target (about a minute on 2 cores); ``-m slow`` compiles every distinct launch
of Qwen3 0.6B-32B and 30B-A3B in bf16, fp16 and float32, FP8 and AWQ weights, FP8 KV pages, page sizes
16, 32 and 64. The check runs in a subprocess: tests/conftest.py sets TRITON_INTERPRET=1, under which kernels
cannot be compiled.

The device-dependent choices (tiles and stages by shared memory, split K by SM count, start-up refusal)
are tested here directly, as pure functions.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mili.errors import InvalidRequest  # noqa: E402
from mili.tools.triton_checks import compile_check  # noqa: E402
from mili.kernels.triton.launch import TARGETS, DeviceSpec, check_device, gemm_config, gemm_smem_bound  # noqa: E402


def _run(args: list[str]) -> str:
    result = compile_check.run(args)
    print(result.stdout)  # the inventory table (pytest -s shows it)
    assert result.returncode == (1 if "--broken" in args else 0), result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_every_kernel_compiles_for_every_target():
    out = _run([])
    for kernel in ("_rms_norm_kernel", "_qk_norm_rope_kernel", "_store_kv_kernel", "_decode_kernel",
                   "_decode_reduce_kernel", "_varlen_kernel", "_fp8_gemm_kernel", "_int4_gemm_kernel", "_int8_gemm_kernel",
                   "_group_quant_kernel", "_grouped_gemm_kernel", "_lora_shrink_kernel", "_lora_expand_kernel",
                   "_silu_and_mul_kernel", "_qk_norm_rope_store_kernel", "_gemv_kernel", "_gemv_reduce_kernel"):
        assert kernel in out
    for target in TARGETS:
        assert f"| {target} " in out
    assert "FP8_ACT=1" in out and "FP8=1" in out and "split-K" in out and " 0 failed" in out


@pytest.mark.slow
def test_every_launch_of_every_supported_shape_compiles():
    _run(["--full"])


def test_the_check_fails_on_a_tile_too_large_for_sm80():
    out = _run(["--targets", "", "--broken"])  # the broken launch alone
    broken = [line for line in out.splitlines() if "| broken " in line]
    assert broken and "FAIL: shared memory" in broken[0] and "sm_80's 166912 B per block" in broken[0]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("rows", [1, 8, 16, 32, 64, 2048])
@pytest.mark.parametrize("a_bytes,w_bytes", [(1, 1), (2, 1), (2, 0.5), (4, 1), (4, 0.5)])
def test_every_gemm_tile_the_runner_picks_fits_its_device(target, rows, a_bytes, w_bytes):
    spec = TARGETS[target]
    cfg = gemm_config(rows, 128, a_bytes, w_bytes, a_bytes == 4, spec)
    assert gemm_smem_bound(cfg.block_m, cfg.block_n, 128, a_bytes, w_bytes, cfg.num_stages) <= spec.smem_per_block


def test_tiles_depend_on_the_device():
    # the issue's three: AWQ and FP8 prefill tiles that overflowed sm_89's 99 KiB now take fewer stages there
    for a_bytes, w_bytes in ((2, 0.5), (2, 1)):
        h100 = gemm_config(2048, 128, a_bytes, w_bytes, False, TARGETS["sm_90"])
        l4 = gemm_config(2048, 128, a_bytes, w_bytes, False, TARGETS["sm_89"])
        assert (h100.block_m, h100.block_n, h100.num_stages) == (64, 128, 3)
        assert l4.num_stages < h100.num_stages or l4.block_m < h100.block_m
    tiny = DeviceSpec("tiny", (8, 6), 48 * 1024, 10)
    cfg = gemm_config(2048, 128, 2, 1, False, tiny)
    assert (cfg.block_m, cfg.block_n) != (64, 128)
    assert gemm_config(2048, 128, 4, 0.5, True, TARGETS["sm_90"]).block_m == 16  # float32: CUDA-core dots


def test_split_k_follows_the_sm_count():
    from mili.kernels.triton.quant_gemm import gemm_plan

    _, h100, _ = gemm_plan(1, 1024, 64, 128, torch.bfloat16, 0.5, False, TARGETS["sm_90"])
    _, l4, _ = gemm_plan(1, 1024, 64, 128, torch.bfloat16, 0.5, False, TARGETS["sm_89"])
    assert h100 > l4 > 1


def test_a_gpu_the_kernels_cannot_run_on_is_refused_at_start_up():
    v100 = DeviceSpec("Tesla V100", (7, 0), 96 * 1024, 80)
    with pytest.raises(InvalidRequest, match="SM 8.0 or later"):
        check_device(v100, torch.bfloat16)
    with pytest.raises(InvalidRequest, match="shared memory"):
        check_device(DeviceSpec("no smem", (9, 0), 16 * 1024, 1), torch.bfloat16)
    for spec in TARGETS.values():  # (FP8 KV pages below SM 8.9: the plan refuses them, tests/unit/test_plan.py)
        check_device(spec, torch.bfloat16)
