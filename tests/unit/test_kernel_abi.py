"""The CPU kernels' ABI is written once, in mili_kernels.h, and the Python side's ctypes types are read from it
(mili/kernels/cpu/abi.py). These check that reading against the compiler: every exported function has its prototype
there (and nothing else is exported), and each descriptor's ctypes layout is the C compiler's, field by field."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from mili.kernels import cpu
from mili.kernels.cpu import abi

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _cc() -> str:
    return shutil.which("cc") or "cc"


@needs_cc
def test_every_exported_function_is_declared_in_the_header(tmp_path):
    """kernels.c compiles with -Werror=missing-prototypes on every x86 ISA layer (a non-static function without the
    header's prototype is an error), and the built library exports exactly the functions the header declares."""
    isas = [isa for isa in ("avx2", "avx2-vnni", "avx512") if cpu.arch() == "x86_64"] or ["neon"]
    for isa in isas:
        done = subprocess.run([_cc(), "-O0", "-fsyntax-only", *cpu.compile_flags(isa, frozenset({"avx512_vnni",
                                                                                                  "avx512vl"})),
                               "-fopenmp", "-Werror=missing-prototypes", str(cpu.SOURCE)],
                              capture_output=True, text=True)
        assert done.returncode == 0, (isa, done.stderr[-3000:])
    lib, why = cpu.load()
    if lib is None:
        pytest.skip(f"no kernels here: {why}")
    symbols = subprocess.run(["nm", "-D", "--defined-only", lib.mili_path], capture_output=True, text=True,
                             check=True).stdout.split()
    exported = {s for s in symbols if s.startswith("mili_")}
    assert exported == set(abi.FUNCTIONS)
    assert set(cpu.SIGNATURES) == set(abi.FUNCTIONS)


@needs_cc
def test_descriptor_layouts_are_the_compilers(tmp_path):
    """sizeof and every field's offsetof, printed by a C program over the header, equal the ctypes structures', and
    the enums' constants equal the reader's."""
    lines = ['#include <stddef.h>', '#include <stdio.h>', f'#include "{abi.HEADER}"', "int main(void) {"]
    for name in abi.STRUCTS:
        lines.append(f'  printf("{name} %zu\\n", sizeof({name}));')
        for field in abi.FIELDS[name]:
            lines.append(f'  printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    lines += [f'  printf("{name} %d\\n", (int){name});' for name in abi.CONSTANTS]
    lines += ["  return 0;", "}"]
    (tmp_path / "layout.c").write_text("\n".join(lines))
    subprocess.run([_cc(), str(tmp_path / "layout.c"), "-o", str(tmp_path / "layout")], check=True)
    printed = dict(line.split() for line in subprocess.run([str(tmp_path / "layout")], capture_output=True,
                                                              text=True, check=True).stdout.splitlines())
    want = {}
    for name, struct in abi.STRUCTS.items():
        want[name] = str(ctypes.sizeof(struct))
        for field in abi.FIELDS[name]:
            want[f"{name}.{field}"] = str(getattr(struct, field).offset)
    want |= {name: str(value) for name, value in abi.CONSTANTS.items()}
    assert printed == want and {"SCALES_F16", "SCALES_F32", "SCALES_K"} <= set(abi.CONSTANTS)
    assert set(abi.STRUCTS) == {"mili_lora_desc", "mili_linear_desc", "mili_layer_desc", "mili_kv_pages",
                                "mili_seq_pages", "mili_decode_step", "mili_norm_rows", "mili_qk_heads",
                                "mili_prefill_chunk", "mili_gdn_layer", "mili_gdn_step"} and len(want) > 90  # (each field read)


def test_the_reader_refuses_what_it_cannot_read():
    """A field or argument type the reader does not know is an error naming it, not a wrong ctypes type."""
    with pytest.raises(ValueError, match="unknown field type 'double'"):
        abi.parse_structs("typedef struct s { double x; } s;")
    with pytest.raises(ValueError, match="unknown argument type"):
        abi.parse_functions("void mili_f(double x);")
    with pytest.raises(ValueError, match="write the enum constant's value"):
        abi.parse_constants("enum { A = 0, B };")
    with pytest.raises(ValueError, match="keep one name"):
        abi.parse_structs("typedef struct a { int x; } b;")
    got = abi.parse_functions("int mili_f(const bf16 *x, int64_t n, float s, void *const *p);")
    assert got == {"mili_f": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p])}


def test_no_function_takes_more_than_eight_arguments():
    """Past eight, a kernel's arguments go in a descriptor (the header's structs), so that no call is a long list of
    positional pointers and sizes."""
    long = {name: len(args) for name, (_, args) in abi.FUNCTIONS.items() if len(args) > 8}
    assert not long, long
