"""A GGUF file's header: its metadata and its tensors' table, read in one pass without touching the tensors.

gguf-py's ``GGUFReader`` builds numpy views of every element of every array, ~10 s for the 150k-token vocabulary of a
Qwen file (two string arrays and one of integers); this reads the same header in a fraction of a second. The format's
tables (value types, block types and their sizes) are gguf-py's own; ``tests/unit/test_gguf_header.py`` checks the
result against ``GGUFReader`` field by field and tensor by tensor.

    header = read_header(path)
    header.fields["general.architecture"].contents()   # "qwen3"
    [(t.name, t.tensor_type.name, t.shape, t.data_offset, t.n_bytes) for t in header.tensors]

A field has gguf-py's ``ReaderField`` surface that MILI reads: ``types`` (the value's type, then an array's element
type) and ``contents()``. A tensor has ``ReaderTensor``'s: ``name``, ``tensor_type``, ``shape`` (as stored, the
fastest-moving dimension first), ``data_offset`` (from the start of the file) and ``n_bytes``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {  # GGUFValueType name -> struct format
    "UINT8": "<B", "INT8": "<b", "UINT16": "<H", "INT16": "<h", "UINT32": "<I", "INT32": "<i", "FLOAT32": "<f",
    "BOOL": "<?", "UINT64": "<Q", "INT64": "<q", "FLOAT64": "<d"}


@dataclass
class Field:
    types: list
    value: object

    def contents(self):
        return self.value


@dataclass
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int


@dataclass
class Header:
    fields: dict[str, Field]
    tensors: list[Tensor]


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def skip(self, n: int) -> int:
        """The position of the next n bytes, stepped over (ValueError where the file ends before them)."""
        if self.pos + n > len(self.buf):
            raise ValueError(f"the header runs past the end of the file ({n} bytes at {self.pos})")
        self.pos += n
        return self.pos - n

    def take(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.skip(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.take("<Q")
        at = self.skip(n)
        return bytes(self.buf[at:at + n]).decode("utf-8", errors="replace")


def _value(cur: _Cursor, vtype, gguf) -> tuple[list, object]:
    """(types, value) of one value of type ``vtype`` at the cursor."""
    T = gguf.GGUFValueType
    if vtype == T.STRING:
        return [vtype], cur.string()
    if vtype == T.ARRAY:
        sub, count = T(cur.take("<I")), cur.take("<Q")
        if sub == T.STRING:
            return [vtype, sub], [cur.string() for _ in range(count)]
        if sub == T.ARRAY:
            raise ValueError("nested GGUF arrays are not read")
        fmt = _SCALARS[sub.name]
        at = cur.skip(struct.calcsize(fmt) * count)
        return [vtype, sub], np.frombuffer(cur.buf, dtype=np.dtype(fmt), count=count, offset=at).tolist()
    return [vtype], cur.take(_SCALARS[vtype.name])


def read_header(path: Path | str) -> Header:
    """The file's metadata and tensor table. Raises ValueError on a file that is not GGUF v2 / v3 or ends inside its
    header."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"not a GGUF file (its first bytes are {bytes(buf[:4])!r})")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}, where 2 and 3 are read")
        n_tensors, n_fields = cur.take("<Q"), cur.take("<Q")
        fields = {}
        for _ in range(n_fields):
            key = cur.string()
            types, value = _value(cur, gguf.GGUFValueType(cur.take("<I")), gguf)
            fields[key] = Field(types, value)
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            table.append((name, gguf.GGMLQuantizationType(cur.take("<I")), dims, cur.take("<Q")))
        align = int(fields["general.alignment"].value) if "general.alignment" in fields else gguf.GGUF_DEFAULT_ALIGNMENT
        start = -(-cur.pos // align) * align
        tensors = []
        for name, ttype, dims, offset in table:
            block, size = gguf.GGML_QUANT_SIZES[ttype]
            tensors.append(Tensor(name, ttype, dims, start + offset, int(np.prod(dims, dtype=np.int64)) // block * size))
        return Header(fields, tensors)


def transformers_config(header: Header) -> dict:
    """The config fields transformers' GGUF conversion (``load_gguf_checkpoint(...)["config"]``) makes of the file,
    made here from the header already read: its own tables (``GGUF_TO_TRANSFORMERS_MAPPING["config"]``, its defaults
    per architecture) applied as it applies them, for the archs it converts without special cases (qwen3, qwen3moe).
    Its own call parses the whole file again with gguf-py's reader (~12 s for a 150k vocabulary).
    ``tests/unit/test_gguf_header.py`` compares the two."""
    from transformers import modeling_gguf_pytorch_utils as hf

    arch = header.fields["general.architecture"].contents()
    hf_arch = {"qwen3moe": "qwen3_moe"}.get(arch, arch)  # (load_gguf_checkpoint's renames of the archs MILI runs)
    renames = hf.GGUF_TO_TRANSFORMERS_MAPPING["config"]
    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    defaults = getattr(hf, "GGUF_CONFIG_DEFAULTS_MAPPING", {})
    for key, value in (defaults.get(hf_arch) or defaults.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, field in header.fields.items():
        prefix, _, rest = key.replace(arch, hf_arch).partition(".")
        name = renames.get(prefix, {}).get(rest)
        if name is None or name == -1:
            continue
        value = field.contents()
        config[name] = value.replace(arch, hf_arch) if isinstance(value, str) and arch in value else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.fields:
        config["vocab_size"] = len(header.fields["tokenizer.ggml.tokens"].contents())
    return config
