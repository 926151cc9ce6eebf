"""The CPU kernels' ABI as the Python side sees it, read from ``mili_kernels.h`` (the one place it is written; kernels.c
includes the same header, so the compiler holds every definition to it): each exported function's ctypes argument and
return types (:data:`FUNCTIONS`), a ctypes structure per descriptor (:data:`STRUCTS`, by their C names) and the
named constants (:data:`CONSTANTS`).

The header keeps to a small subset of C that this reads: ``enum { NAME = value, ... };`` with every value written,
``typedef struct NAME { fields } NAME;`` with fields of the
scalar types below, pointers, arrays of a constant length and the structs before them, and one prototype a
declaration. Any pointer is ``c_void_p`` in a prototype (callers pass ``data_ptr()`` or ``ctypes.byref``); in a struct,
a pointer to a struct is that structure's ``POINTER``, so a chain of descriptors holds its targets.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).with_name("mili_kernels.h")

SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "float": ctypes.c_float,
           "uint8_t": ctypes.c_uint8, "int8_t": ctypes.c_int8, "uint16_t": ctypes.c_uint16, "bf16": ctypes.c_uint16}
_STRUCT = re.compile(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", re.S)
_PROTO = re.compile(r"^\s*((?:const\s+)?\w+\s*\**)\s*(mili_\w+)\s*\(([^)]*)\)\s*;", re.M)
_ENUM = re.compile(r"\benum\s*\{([^}]*)\}\s*;")
_DECL = re.compile(r"^(?:const\s+)?(?:struct\s+)?(\w+)\s+(.*)$", re.S)


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def _field_type(base: str, declarator: str, structs: dict[str, type]) -> tuple[str, object]:
    """(name, ctypes type) of one declarator (``*name``, ``name[3]``, ``*const *name``) of a field of type ``base``."""
    stars = declarator.count("*")
    m = re.fullmatch(r"[\s*]*(?:const\s*\**\s*)*(\w+)\s*(?:\[(\d+)\])?\s*", declarator)
    if m is None:
        raise ValueError(f"mili_kernels.h: can't read the field {base} {declarator!r}")
    name, length = m.group(1), m.group(2)
    if stars:
        kind = ctypes.POINTER(structs[base]) if stars == 1 and base in structs else ctypes.c_void_p
    elif base in structs:
        kind = structs[base]
    elif base in SCALARS:
        kind = SCALARS[base]
    else:
        raise ValueError(f"mili_kernels.h: unknown field type {base!r} ({name})")
    return name, kind * int(length) if length else kind


def parse_structs(text: str) -> dict[str, type]:
    """The ctypes structures of the header text's descriptors (comments stripped), by their C names."""
    structs: dict[str, type] = {}
    for tag, body, name in _STRUCT.findall(text):
        if tag != name:
            raise ValueError(f"mili_kernels.h: struct {tag} is typedef'd as {name}: keep one name")
        cls = type(name, (ctypes.Structure,), {"__doc__": f"kernels' {name} (mili_kernels.h)"})
        structs[name] = cls  # (before its fields: a field may point to its own kind, as ``next`` does)
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            m = _DECL.match(decl)
            if m is None:
                raise ValueError(f"mili_kernels.h: can't read the field {decl!r} of {name}")
            base, declarators = m.groups()
            fields += [_field_type(base, d, structs) for d in declarators.split(",")]
        cls._fields_ = fields
    return structs


def parse_constants(text: str) -> dict[str, int]:
    """name -> value of the header text's enums (comments stripped), each value written out."""
    out = {}
    for body in _ENUM.findall(text):
        for item in filter(None, (i.strip() for i in body.split(","))):
            m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", item)
            if m is None:
                raise ValueError(f"mili_kernels.h: write the enum constant's value: {item!r}")
            out[m.group(1)] = int(m.group(2))
    return out


def _argument(arg: str) -> object:
    arg = arg.strip()
    if "*" in arg:
        return ctypes.c_void_p
    base = arg.replace("const ", "").split()[0]
    if base not in SCALARS:
        raise ValueError(f"mili_kernels.h: unknown argument type in {arg!r}")
    return SCALARS[base]


def _return(kind: str) -> object:
    kind = " ".join(kind.replace("*", " * ").split())
    if kind == "void":
        return None
    if kind == "const char *":
        return ctypes.c_char_p
    if kind in SCALARS:
        return SCALARS[kind]
    raise ValueError(f"mili_kernels.h: unknown return type {kind!r}")


def parse_functions(text: str) -> dict[str, tuple[object, list]]:
    """name -> (restype, argtypes) of the header text's prototypes (comments stripped)."""
    out = {}
    for ret, name, args in _PROTO.findall(text):
        args = " ".join(args.split())
        out[name] = (_return(ret), [] if args in ("", "void") else [_argument(a) for a in args.split(",")])
    return out


_TEXT = _strip_comments(HEADER.read_text())
STRUCTS: dict[str, type] = parse_structs(_TEXT)
FUNCTIONS: dict[str, tuple[object, list]] = parse_functions(_TEXT)  # name -> (restype, argtypes)
CONSTANTS: dict[str, int] = parse_constants(_TEXT)
FIELDS: dict[str, list[str]] = {name: [f for f, _ in struct._fields_] for name, struct in STRUCTS.items()}


def bind(lib: ctypes.CDLL) -> None:
    """Sets every function's ``argtypes`` and ``restype`` on ``lib`` (a function the library lacks is skipped: an
    older version, as the benchmarks' A/B builds may be)."""
    for name, (restype, argtypes) in FUNCTIONS.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
