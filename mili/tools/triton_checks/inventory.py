"""Every distinct Triton launch the runner makes for a set of model shapes on one target, derived by calling
the wrappers' own configuration functions (``*_meta``, ``quant_gemm.gemm_plan``) with the shapes, dtypes and
phases the runner sees: model dtypes bf16 / fp16 / float32, FP8 block and per-channel weights (W8A8 on SM 89+,
weight-only elsewhere and in float32), AWQ int4, ``--quantization int8`` (weight-only, every linear and the
lm_head, MoE experts one by one), FP8 KV pages (SM 89+), LoRA adapters (ranks up to 256, fused layers of 1 to 3
shards), the small-batch GEMV on plain bf16 / fp16 linears (1 to 8 rows); decode (batches of 1 to 512 rows, split
K), prefill (chunks up to 2048 tokens; attention: the one kernel over a step's decodes and chunks).

Must be called where ``TRITON_INTERPRET`` is unset (``exact_dots`` reads it: the GPU's choice is wanted).
"""

from __future__ import annotations

import torch

from mili.kernels.triton import attention, fused_moe, gemv, lora, norm_rope, quant_gemm, swiglu, varlen_attention
from mili.tools.triton_checks.aot import Launch
from mili.kernels.triton.launch import DeviceSpec, gemm_smem_bound
from mili.kernels.triton.quant_gemm import fp8_activations

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS = (1, 4, 8, 16, 32, 64, 256, 2048)  # decode batches (CUDA graphs' ladder) and prefill chunks
PAGE_SIZES = (16, 32, 64)  # what the Triton backend accepts (config.py)
AWQ_GROUPS = (128, 64, 32)
LORA_RANKS = (8, 16, 64, 256)  # --max-lora-rank: what the kernels' tiles depend on (the expand's BLOCK_K, RANK)
F32, I32, I64, F8, U8, I8 = torch.float32, torch.int32, torch.int64, torch.float8_e4m3fn, torch.uint8, torch.int8


def _ptrs(**kw) -> tuple:
    return tuple(kw.items())


def _consts(meta: dict) -> tuple:
    return tuple(meta.items())


def _attention(cfg: dict, dtype, kv, page: int) -> list[Launch]:
    d, group = cfg["head_dim"], cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    fp8 = kv == F8
    out = [Launch("attention._store_kv_kernel", "any", _consts(attention.store_kv_meta(d, kv)),
                  _ptrs(K=dtype, V=dtype, KC=kv, VC=kv, SLOTS=I64), ("k_scale", "v_scale"),
                  ("stride_kt", "stride_vt", "stride_cs", "stride_ch", "stride_kh", "stride_vh"), needs_fp8=fp8),
           *(Launch("attention._decode_kernel", "decode", _consts(attention.decode_meta(group, page, d, dtype, single)),
                    _ptrs(Q=dtype, KC=kv, VC=kv, PT=I64, CTX=I32, OUT=dtype, OUT_ACC=F32, OUT_ML=F32),
                    ("scale", "v_scale"), ("stride_qb", "stride_qh", "stride_cp", "stride_cs", "stride_ch", "stride_ob",
                                           "stride_oh", "stride_ab", "stride_ah"), needs_fp8=fp8)
             for single in (False, True)),
           Launch("varlen_attention._varlen_kernel", "prefill",
                  _consts(varlen_attention.varlen_meta(group, page, d, dtype)),
                  _ptrs(Q=dtype, KC=kv, VC=kv, OUT=dtype, PT=I64, QSTART=I32, QLEN=I32, CTX=I32), ("scale", "v_scale"),
                  ("stride_qt", "stride_qh", "stride_cp", "stride_cs", "stride_ch", "stride_ot", "stride_oh"),
                  needs_fp8=fp8)]
    for splits in attention.decode_reduce_splits():  # (the split count depends on the batch and the device)
        out.append(Launch("attention._decode_reduce_kernel", "decode",
                          _consts(attention.decode_reduce_meta(d, splits)), _ptrs(ACC=F32, ML=F32, OUT=dtype),
                          aligned=("stride_ab", "stride_ah", "stride_ob", "stride_oh")))
    return out


def _norms(cfg: dict, dtype) -> list[Launch]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    return [Launch("norm_rope._rms_norm_kernel", "any", _consts(norm_rope.rms_norm_meta(h, res)),
                   _ptrs(X=dtype, R=dtype, W=dtype, OUT=dtype, R_OUT=dtype), ("eps",),
                   ("stride_x", "stride_r", "stride_o", "stride_ro")) for res in (False, True)] + \
        [Launch("norm_rope._qk_norm_rope_kernel", "any", _consts(norm_rope.qk_norm_rope_meta(d)),
                _ptrs(X=dtype, W=dtype, COS=F32, SIN=F32, OUT=dtype), ("eps",),
                ("stride_xt", "stride_xh", "stride_ot", "stride_oh", "stride_c"))]


def _norm_rope_store(cfg: dict, dtype, kv) -> list[Launch]:
    """Qwen3 attention's q/k-norm + RoPE with the K/V store (the Triton back-end's one launch), into ``kv`` pages."""
    return [Launch("norm_rope._qk_norm_rope_store_kernel", "any",
                   _consts(norm_rope.qk_norm_rope_store_meta(cfg["head_dim"], kv)),
                   _ptrs(Q=dtype, K=dtype, V=dtype, QW=dtype, KW=dtype, COS=F32, SIN=F32, Q_OUT=dtype, KC=kv, VC=kv,
                         SLOTS=I64), ("eps", "k_scale", "v_scale"),
                   ("stride_qt", "stride_kt", "stride_vt", "stride_ot", "stride_cs", "stride_ch", "stride_qh",
                    "stride_kh", "stride_vh", "stride_oh", "stride_c"), needs_fp8=kv == F8)]


def _swiglu(cfg: dict, dtype) -> list[Launch]:
    """SwiGLU of the dense MLP and of a MoE model's experts (fused_moe's activation)."""
    widths = {cfg["intermediate_size"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]}
    return [Launch("swiglu._silu_and_mul_kernel", "any", _consts(swiglu.silu_and_mul_meta(i)),
                   _ptrs(GATE_UP=dtype, OUT=dtype), aligned=("stride_g", "stride_o")) for i in sorted(widths)]


def _gemv(cfg: dict, dtype, spec: DeviceSpec) -> list[Launch]:
    """The small-batch GEMV (decode batches of 1 to 8 rows; its tiles do not depend on the rows) on the plain
    bf16 / fp16 linears and the lm_head, with its reduce pass where K is split; with a bias where the attention
    has one."""
    if dtype not in (torch.bfloat16, torch.float16):
        return []
    out = []
    bias = (False, True) if cfg.get("attention_bias") else (False,)
    for n, k in linear_shapes(cfg) + [(cfg["vocab_size"], cfg["hidden_size"])]:
        for has_bias in bias:
            gc = gemv.gemv_config(n, k, dtype, spec)
            meta = gemv.gemv_meta(gc, dtype, has_bias)
            options = dict(num_warps=meta.pop("num_warps"), num_stages=meta.pop("num_stages"))
            out.append(Launch("gemv._gemv_kernel", "split-K" if gc.split > 1 else "decode", _consts(meta),
                              _ptrs(X=dtype, W=dtype, BIAS=dtype, OUT=F32 if gc.split > 1 else dtype),
                              aligned=("K", "stride_xm", "stride_wn", "stride_os", "stride_om"), **options))
            if gc.split > 1:
                out.append(Launch("gemv._gemv_reduce_kernel", "split-K", _consts(gemv.gemv_reduce_meta(has_bias)),
                                  _ptrs(PARTS=F32, BIAS=dtype, OUT=dtype),
                                  aligned=("N", "stride_ps", "stride_pm", "stride_om")))
    return out


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(N, K) of the model's quantized linears: q|k|v, o, gate|up, down (the dense MLP's)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    inter = cfg["intermediate_size"]
    return [(qkv, h), (h, cfg["num_attention_heads"] * d), (2 * inter, h), (h, inter)]


def int8_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(N, K) of what ``--quantization int8`` puts on the int8 GEMM: the linears, the lm_head (tied or not: an
    int8 copy), and a MoE model's experts (each one's gate|up and down)."""
    h, shapes = cfg["hidden_size"], linear_shapes(cfg) + [(cfg["vocab_size"], cfg["hidden_size"])]
    if cfg.get("num_experts"):
        inter = cfg["moe_intermediate_size"]
        shapes += [(2 * inter, h), (h, inter)]
    return shapes


def _phase(m: int, split: int) -> str:
    return "split-K" if split > 1 else ("decode" if m <= 16 else "prefill")


def _gemms(cfg: dict, dtype, spec: DeviceSpec, awq_groups) -> list[Launch]:
    out = []
    fp8_act = fp8_activations("cuda", spec.capability, dtype)
    for n, k in linear_shapes(cfg):
        for m in ROWS:
            for scale_block in ((128, 128), (1, k)):  # Qwen's FP8 blocks; compressed-tensors' per channel
                if fp8_act and scale_block[0] == 1:
                    continue  # per channel in W8A8 runs on torch._scaled_mm
                block_k = quant_gemm.fp8_block_size(scale_block, k)
                a_dtype = F8 if fp8_act else dtype
                gc, split, _ = quant_gemm.gemm_plan(m, n, -(-k // block_k), block_k, a_dtype, 1, dtype == F32, spec)
                meta = dict(SCALE_N=scale_block[0], SCALE_K=scale_block[1], FP8_ACT=fp8_act, BLOCK_K=block_k,
                            BLOCK_M=gc.block_m, BLOCK_N=gc.block_n, EXACT=attention.exact_dots(dtype))
                out.append(Launch("quant_gemm._fp8_gemm_kernel", _phase(m, split), _consts(meta),
                                  _ptrs(A=a_dtype, A_SCALE=F32 if fp8_act else dtype, W=F8 if fp8_act else U8,
                                        W_SCALE=F32, C=F32 if split > 1 else dtype),
                                  aligned=("K", "stride_am", "stride_wn", "stride_cs", "stride_cm"),
                                  num_warps=gc.num_warps, num_stages=gc.num_stages, needs_fp8=fp8_act))
            for group in awq_groups:
                block_k = quant_gemm.int4_block_size(group, k)
                gc, split, _ = quant_gemm.gemm_plan(m, n, k // block_k, block_k, dtype, 0.5, dtype == F32, spec)
                meta = dict(GROUP=group, BLOCK_K=block_k, BLOCK_M=gc.block_m, BLOCK_N=gc.block_n,
                            EXACT=attention.exact_dots(dtype))
                out.append(Launch("quant_gemm._int4_gemm_kernel", _phase(m, split), _consts(meta),
                                  _ptrs(A=dtype, QW=I32, ZEROS=U8, SCALES=torch.float16, C=F32 if split > 1 else dtype),
                                  aligned=("K", "stride_am", "stride_qn", "stride_cs", "stride_cm"),
                                  num_warps=gc.num_warps, num_stages=gc.num_stages))
    block_k = quant_gemm.INT8_BLOCK_K
    for n, k in int8_shapes(cfg):
        for m in ROWS:
            gc, split, _ = quant_gemm.gemm_plan(m, n, -(-k // block_k), block_k, dtype, 1, dtype == F32, spec)
            meta = dict(BLOCK_K=block_k, BLOCK_M=gc.block_m, BLOCK_N=gc.block_n, EXACT=attention.exact_dots(dtype))
            out.append(Launch("quant_gemm._int8_gemm_kernel", _phase(m, split), _consts(meta),
                              _ptrs(A=dtype, W=I8, W_SCALE=F32, C=F32 if split > 1 else dtype),
                              aligned=("K", "stride_am", "stride_wn", "stride_cs", "stride_cm"),
                              num_warps=gc.num_warps, num_stages=gc.num_stages))
    if fp8_act:
        out.append(Launch("quant_gemm._group_quant_kernel", "any", (("GROUP", quant_gemm.FP8_GROUP),),
                          _ptrs(X=dtype, Q=F8, S=F32), aligned=("K", "stride_xm", "stride_qm"), needs_fp8=True))
    return out


def _moe(cfg: dict, dtype) -> list[Launch]:
    if not cfg.get("num_experts"):
        return []
    return [Launch("fused_moe._grouped_gemm_kernel", "any",
                   _consts(fused_moe.grouped_gemm_meta(cfg["num_experts_per_tok"], second, second, dtype)),
                   _ptrs(A=dtype, W=dtype, C=dtype, PAIRS=I64, BLOCK_EXPERT=I64, WEIGHTS=dtype),
                   aligned=("N", "K", "stride_am", "stride_we", "stride_wn", "stride_cm")) for second in (False, True)]


def _lora(dtype) -> list[Launch]:
    """The adapters' shrink and expand (``lora.lora_add``): their tiles depend on the rows (the longest segment),
    the rank, the fused layer's shard count and the dtype, not on the model's shapes."""
    out = []
    for m in ROWS:
        phase = "decode" if m <= 16 else "prefill"
        for rank in LORA_RANKS:
            for shards in (1, 2, 3):
                u_aligned = shards * rank % 16 == 0  # (u's rows are W wide)
                shrink, expand = lora.shrink_meta(m, shards * rank, dtype), lora.expand_meta(m, rank, shards, dtype)
                out.append(Launch("lora._lora_shrink_kernel", phase, _consts(shrink),
                                  _ptrs(X=dtype, A=dtype, U=F32, ROWS=I32, SEG_SLOT=I32, SEG_START=I32, SEG_LEN=I32),
                                  aligned=("K", "stride_xm", "stride_am") + ("stride_us", "stride_um") * u_aligned,
                                  **lora.options(shrink)))
                out.append(Launch("lora._lora_expand_kernel", phase, _consts(expand),
                                  _ptrs(U=F32, B=dtype, Y=dtype, ROWS=I32, SEG_SLOT=I32, SEG_START=I32, SEG_LEN=I32,
                                        SHARD_ENDS=I32),
                                  aligned=("stride_bn", "stride_ym") + ("stride_um",) * u_aligned,
                                  **lora.options(expand)))
    return out


def launches(configs: list[dict], spec: DeviceSpec, full: bool = True) -> list[Launch]:
    """The distinct launches for ``configs`` (HF config dicts) on ``spec``, FP8 ones only where it has FP8.
    ``full=False``: bf16 and float32 only, one page size, AWQ group 128."""
    dtypes = DTYPES if full else (torch.bfloat16, F32)
    pages = PAGE_SIZES if full else PAGE_SIZES[:1]
    seen: dict[tuple, Launch] = {}
    for cfg in configs:
        for dtype in dtypes:
            found = _norms(cfg, dtype) + _moe(cfg, dtype) + _gemms(cfg, dtype, spec, AWQ_GROUPS if full else (128,)) \
                + _lora(dtype) + _swiglu(cfg, dtype) + _gemv(cfg, dtype, spec)
            for kv in (dtype, F8) if spec.has_fp8 else (dtype,):
                found += _norm_rope_store(cfg, dtype, kv)
                for page in pages:
                    found += _attention(cfg, dtype, kv, page)
            for launch in found:
                if spec.has_fp8 or not launch.needs_fp8:
                    seen.setdefault((launch.kernel, launch.constexprs, launch.pointers, launch.num_warps,
                                     launch.num_stages), launch)
    return list(seen.values())


def gemm_bounded(launch: Launch) -> bool:
    """A GEMM whose tiles the runtime picks by ``launch.gemm_smem_bound`` (the quantized and the MoE GEMMs, the
    GEMV; the LoRA kernels' small tiles are held to the device's limit alone)."""
    c = dict(launch.constexprs)
    return "BLOCK_N" in c and "BLOCK_K" in c and launch.kernel.startswith(("quant_gemm.", "fused_moe.", "gemv."))


def risk(launch: Launch) -> int:
    """What the default run keeps of a (kernel, phase): the launch with the most shared memory (a GEMM's
    bound), then the most constexpr volume."""
    c = dict(launch.constexprs)
    if gemm_bounded(launch):
        ptrs = dict(launch.pointers)
        if "X" in ptrs:  # (the GEMV: x and W both of the model's dtype)
            a = w = ptrs["X"].itemsize
        else:
            a, w = 1 if ptrs.get("A") == F8 else ptrs["A"].itemsize, 0.5 if "GROUP" in c else 1
        return gemm_smem_bound(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], a, w, launch.num_stages)
    return sum(v for v in c.values() if isinstance(v, int) and not isinstance(v, bool))


def representatives(all_launches: list[Launch]) -> list[Launch]:
    """One launch per (kernel, phase, FP8-ness, float32 dots, decode's one-split form): the riskiest."""
    best: dict[tuple, Launch] = {}
    for launch in all_launches:
        c = dict(launch.constexprs)
        key = (launch.kernel, launch.phase, launch.needs_fp8, c.get("EXACT", False), c.get("SINGLE", False))
        if key not in best or risk(launch) > risk(best[key]):
            best[key] = launch
    return list(best.values())
