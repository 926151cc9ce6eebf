"""MILI's GGUF header reader (mili.model.gguf_header) against gguf-py's GGUFReader, the reference: the same fields
(types and contents) and the same tensor table (names, types, shapes, absolute data offsets, byte counts), on a file
written by gguf-py's GGUFWriter with every value type, arrays of each kind, a non-default alignment and tensors of
several block types; and a clear error where the header ends early."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from mili.model.gguf_header import read_header  # noqa: E402


def _same_as_gguf_py(path) -> None:
    ours, ref = read_header(path), gguf.GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # (GGUFReader's own entries: version and counts)
    assert list(ours.fields) == keys
    for key in keys:
        assert [int(t) for t in ours.fields[key].types] == [int(t) for t in ref.fields[key].types], key
        assert ours.fields[key].contents() == ref.fields[key].contents(), key
    assert [(t.name, t.tensor_type, tuple(t.shape), t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
         for t in ref.tensors]


def _write(path, alignment: int | None) -> None:
    g = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    T = gguf.GGUFValueType
    for name, value, vtype in [("u8", 7, T.UINT8), ("i8", -7, T.INT8), ("u16", 700, T.UINT16), ("i16", -700, T.INT16),
                               ("u32", 70000, T.UINT32), ("i32", -70000, T.INT32), ("f32", 0.25, T.FLOAT32),
                               ("b", True, T.BOOL), ("u64", 2 ** 40, T.UINT64), ("i64", -2 ** 40, T.INT64),
                               ("f64", 1e-300, T.FLOAT64), ("s", "héllo <|im_end|>", T.STRING), ("empty", "", T.STRING)]:
        w.add_key_value(f"test.{name}", value, vtype)
    w.add_key_value("test.strings", ["a", "", "Ġthe", "日本"] * 50, T.ARRAY, sub_type=T.STRING)
    w.add_key_value("test.ints", list(range(-5, 300)), T.ARRAY, sub_type=T.INT32)
    w.add_key_value("test.floats", [0.5, -1.5, 3.0], T.ARRAY, sub_type=T.FLOAT32)
    w.add_tensor("a.f32", g.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.f16", g.standard_normal((64,)).astype(np.float16))
    for name, qtype, shape in [("c.q8_0", gguf.GGMLQuantizationType.Q8_0, (4, 64)),
                               ("d.q4_0", gguf.GGMLQuantizationType.Q4_0, (3, 32))]:
        w.add_tensor(name, gguf.quants.quantize(g.standard_normal(shape).astype(np.float32), qtype), raw_dtype=qtype)
    # (a K block type as raw bytes: gguf-py quantizes none of them; 2 rows of one 144-byte Q4_K block)
    w.add_tensor("e.q4_k", g.integers(0, 256, (2, 144), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_header_is_gguf_readers(tmp_path, alignment):
    path = tmp_path / "all.gguf"
    _write(path, alignment)
    _same_as_gguf_py(path)


def test_a_header_cut_short_is_an_error(tmp_path):
    path = tmp_path / "all.gguf"
    _write(path, None)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:300])  # (inside its metadata)
    with pytest.raises(ValueError, match="past the end of the file"):
        read_header(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1"):
        read_header(bad)


@pytest.mark.parametrize("kind", ["q8_0", "moe", "f16_bf16"])
def test_config_is_transformers_conversion(gguf_model, kind):
    """transformers_config (transformers' tables applied to the header MILI read) is what transformers' own
    load_gguf_checkpoint makes of the file's config: dense, MoE, untied and tied."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from mili.model.gguf_header import transformers_config

    path, _ = gguf_model(kind)
    assert transformers_config(read_header(path)) == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
