"""Ahead-of-time compilation of one Triton launch for a real NVIDIA target, without a GPU.

``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))`` runs the
whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas bundled in the triton wheel) on the
CPU. The compiled kernel's metadata gives the shared memory a block needs (``shared``, what Triton checks
at launch against the device's limit); registers and spills are what ``ptxas -v`` reports for the PTX
(Triton reads them from the loaded module, which needs a GPU).

This must run in a process where ``TRITON_INTERPRET`` is not set: under the interpreter ``@triton.jit``
makes interpreted functions, which cannot be compiled (``compile_check.run`` starts such a process).

Version-specific (triton 3.6 on the GPU machines, 3.9 in the CPU tests), marked ``[triton-version]``:
the ``attrs`` format of ASTSource, the way the bundled ptxas is found, the ``metadata`` field names.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch

_TL_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
            torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.int8: "i8"}


@dataclass(frozen=True)
class Launch:
    """One distinct launch of a kernel as the runner makes it: its constexprs, its pointer arguments'
    dtypes, the integer arguments known to be multiples of 16 (Triton's launcher specializes those, as it
    does pointers, as 16-byte aligned), the float scalars, and the launch options."""
    kernel: str  # "module._kernel_name" under mili.kernels.triton
    phase: str  # decode | prefill | split-K | any
    constexprs: tuple  # ((name, value), ...)
    pointers: tuple  # ((name, torch dtype), ...)
    floats: tuple = ()  # names of float32 scalar arguments
    aligned: tuple = ()  # names of integer arguments that are multiples of 16
    num_warps: int = 4
    num_stages: int = 3
    needs_fp8: bool = False  # uses the fp8 type: SM 89+ only

    def config(self) -> str:
        c = dict(self.constexprs)
        ptrs = ",".join(f"{n}:{_TL_TYPE[d]}" for n, d in self.pointers if d not in (torch.int32, torch.int64))
        consts = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in c.items())
        return f"{consts} w{self.num_warps}s{self.num_stages} [{ptrs}]"


@dataclass
class Compiled:
    shared: int
    regs: int
    spills: int  # bytes of spill stores
    extra: dict = field(default_factory=dict)


def _fn(kernel: str):
    import importlib

    module, name = kernel.rsplit(".", 1)
    fn = getattr(importlib.import_module(f"mili.kernels.triton.{module}"), name)
    if not hasattr(fn, "arg_names") or not hasattr(fn, "cache_key"):
        raise RuntimeError("AOT compilation needs real @triton.jit kernels: unset TRITON_INTERPRET "
                           "(use mili.tools.triton_checks.compile_check.run, which starts a clean process)")
    return fn


def source(launch: Launch):
    """The ASTSource of ``launch``: every non-constexpr argument typed, the aligned ones marked."""
    from triton.compiler import ASTSource

    fn = _fn(launch.kernel)
    consts, ptrs = dict(launch.constexprs), dict(launch.pointers)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in ptrs:
            signature[name] = "*" + _TL_TYPE[ptrs[name]]
            attrs[(i,)] = [["tt.divisibility", 16]]  # [triton-version] 3.3+: {(arg index,): [[attr, value]]}
        elif name in launch.floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in launch.aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = set(consts) - set(fn.arg_names)
    if missing:
        raise ValueError(f"{launch.kernel} has no argument(s) {sorted(missing)}")
    return ASTSource(fn, signature, consts, attrs)


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself runs for ``arch`` (3.9 bundles a second one for SM 90+: the PTX it writes
    for those targets needs the newer ptxas)."""
    import triton.backends.nvidia.compiler as nv

    if hasattr(nv, "get_ptxas"):  # [triton-version] 3.9: get_ptxas(arch); 3.6: get_ptxas() or knobs
        try:
            return nv.get_ptxas(arch).path
        except TypeError:
            return nv.get_ptxas().path
    from triton import knobs

    return knobs.nvidia.ptxas.path


_PTXAS_LINE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, bytes of spill stores) that ``ptxas -v`` reports for ``ptx`` (its own .target)."""
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)  # sm_90a
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        command = [_ptxas(int(re.sub(r"\D", "", arch))), "-v", f"--gpu-name={arch}", src, "-o",
                   os.path.join(tmp, "k.cubin")]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    regs, spills = _REGS.search(log), _PTXAS_LINE.search(log)
    return int(regs.group(1)) if regs else 0, int(spills.group(1)) if spills else 0


def compile_launch(launch: Launch, capability: tuple[int, int]) -> Compiled:
    """Compile ``launch`` for ``capability`` (e.g. (9, 0)); raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    kernel = triton.compile(source(launch), target=target,
                            options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    shared = kernel.metadata.shared  # [triton-version] KernelMetadata.shared: bytes of dynamic shared memory
    regs, spills = ptxas_usage(kernel.asm["ptx"])
    return Compiled(shared, regs, spills)
