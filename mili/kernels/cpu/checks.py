"""Each CPU path tried once at load on a tiny input against its reference, before the engine takes it: a path that
raises or disagrees is not used (the next one down runs), and :func:`describe` says which path each layer family
takes and why. The inputs are small (a few hundred microseconds a library), deterministic, and of the shapes the
kernels take (16-column blocks, K a multiple of 64, head dim 64)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mili.kernels import reference

BF16 = torch.bfloat16


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    """"" if ``got`` matches ``want`` within ``tol`` of its largest magnitude, else how far it is off."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} against {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    bound = tol * max(want.abs().max().item(), 1e-6)
    return "" if err <= bound else f"off by {err:.3g} (bound {bound:.3g})"


def _inputs(n: int, k: int, m: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 31 + k)
    return torch.randn(m, k, generator=g).to(BF16), torch.randn(n, k, generator=g).to(BF16)


def check_core(lib) -> str:
    """The bf16 linear (one row and several), RMSNorm, SwiGLU and decode attention of ``lib``, each against torch:
    "" or what failed."""
    from mili.kernels.cpu import ops

    try:
        with ops.library(lib):
            for m in (1, 7):
                x, w = _inputs(48, 128, m)
                why = _close(ops.linear(x, ops.pack_weight(w), 48), x.float() @ w.float().T, 2e-2)
                if why:
                    return f"bf16 linear (M={m}): {why}"
            x, w = _inputs(64, 64, 2)
            norm = torch.rand(64).to(BF16) + 0.5
            why = _close(ops.rms_norm(x, norm, 1e-6), reference.rms_norm(x, norm, 1e-6), 2e-2)
            if why:
                return f"RMSNorm: {why}"
            gate_up = torch.cat([x, w[:2]], dim=1)
            why = _close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), 2e-2)
            if why:
                return f"SwiGLU: {why}"
            g = torch.Generator().manual_seed(3)
            q, k, v = (torch.randn(n, 2, 64, generator=g).to(BF16) for n in (1, 2, 2))  # [tokens, heads, D]
            cache = [t.reshape(1, 2, 2, 64).transpose(1, 2).contiguous() for t in (k, v)]  # one page, head-major
            got = ops.decode_attention(q, cache[0], cache[1], torch.zeros(1, 1, dtype=torch.long), [2], 0.125)
            want = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                                  v.transpose(0, 1).float(), scale=0.125).transpose(0, 1)
            why = _close(got, want, 3e-2)
            if why:
                return f"decode attention: {why}"
    except Exception as exc:  # noqa: BLE001  (a path that raises is not used, whatever it raised)
        return f"{type(exc).__name__}: {exc}"
    return ""


def check_int(lib) -> str:
    """The int8, int4 and int8g linears of ``lib`` against their dequantized weights: "" or what failed."""
    from mili.kernels.cpu import ops

    try:
        with ops.library(lib):
            x, w = _inputs(32, 128, 2)
            scales = w.float().abs().amax(dim=1) / 127
            q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
            packed = ops.pack_weight(q)
            got = ops.linear_int8(x, packed, scales.contiguous(), ops.int8_column_sums(packed), 32)
            why = _close(got, x.float() @ (q.float() * scales[:, None]).T, 3e-2)
            if why:
                return f"int8 linear: {why}"
            g = torch.Generator().manual_seed(4)
            q4 = torch.randint(0, 16, (32, 128), generator=g, dtype=torch.uint8)
            s4, b4 = torch.rand(32, 2, generator=g) * 0.1, torch.randn(32, 2, generator=g) * 0.1
            got = ops.linear_int4(x, *ops.pack_int4(q4, s4, b4))
            dense = q4.float() * s4.repeat_interleave(64, dim=1) + b4.repeat_interleave(64, dim=1)
            why = _close(got, x.float() @ dense.T, 3e-2)
            if why:
                return f"int4 linear: {why}"
            # two-level scales (GGUF's K-quants as stored): fp16 d per super-block of 2 groups, int8 sc per group
            d = (torch.rand(32, 2, generator=g) * 0.01).half().float()
            sc = torch.randint(-8, 32, (32, 4), generator=g, dtype=torch.int8)
            got = ops.linear_int4(x, *ops.pack_int4(q4, (d, sc), (-d, sc.abs())))
            s = d.repeat_interleave(2, dim=1) * sc.float()
            dense = (q4.float() * s.repeat_interleave(32, dim=1) - s.abs().repeat_interleave(32, dim=1))
            why = _close(got, x.float() @ dense.T, 3e-2)
            if why:
                return f"int4 linear (two-level scales): {why}"
            u = torch.randint(0, 256, (32, 128), generator=g, dtype=torch.uint8)
            s8 = torch.rand(32, 4, generator=g) * 0.01
            for b8 in (torch.randn(32, 4, generator=g), None):  # (None: w = s (u - 128))
                got = ops.linear_int8g(x, *ops.pack_int8g(u, s8, b8))
                dense = s8.repeat_interleave(32, dim=1) * (u.float() - 128 if b8 is None else u.float())
                dense = dense if b8 is None else dense + b8.repeat_interleave(32, dim=1)
                why = _close(got, x.float() @ dense.T, 3e-2)
                if why:
                    return f"int8g linear{' (symmetric)' if b8 is None else ''}: {why}"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return ""


@functools.cache
def onednn_bf16(held: bool = False) -> str:
    """"" where oneDNN's bf16 weight packing (PackedLinear) runs here, else why not. ``held``: the kernels are held
    below AVX-512 (MILI_CPU_ISA), and oneDNN's bf16 with them, as on a CPU without it (it needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT), so that MILI_CPU_ISA=avx2 runs what an AVX2 machine runs."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "torch says this CPU lacks it: it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT"
    if held:
        return "held off below AVX-512, as on a CPU without it"
    try:
        x, w = _inputs(48, 64, 3)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        why = _close(got, F.linear(x, w), 2e-2)
        return f"its probe disagreed: {why}" if why else ""
    except Exception as exc:  # noqa: BLE001
        return f"its probe raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
