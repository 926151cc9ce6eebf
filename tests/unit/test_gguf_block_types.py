"""GGUF's block types as objects (model/gguf_blocks/: one module a type, behind one registry). Every registered type
is checked here against gguf-py itself: its block's size, and its parts (``group_parts``) giving
``gguf.quants.dequantize`` of the same blocks exactly, on the kernel it names. A new type is one module of that
package: these tests take it up as it registers; its own test below runs a tiny model stored in it."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.gguf_files import dequantized_state_dict, encode_tensor, write_gguf
from support.parity import assert_greedy_matches_hf, hf_greedy

from mili import LLM, SamplingParams
from mili.model.formats.kernel import cpu_form, quantized_cpu_layer
from mili.model.gguf_blocks import BLOCK_TYPES, block_type, group_parts

TYPES = sorted(BLOCK_TYPES)
ROWS, COLS = 32, 512  # (a multiple of every block, and of the kernels' 16 rows)


def _parts(type_name: str, seed: int = 1):
    """(blocks, their GroupParts, gguf-py's dequantize of them [ROWS, COLS]) of seeded random weights in
    ``type_name``: quantized by gguf-py where it can, else random valid blocks (support.gguf_files)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.2, size=(ROWS, COLS)).astype(np.float32)
    data, qtype = encode_tensor(w, type_name, rng)
    return data, group_parts(data, type_name, (ROWS, COLS)), gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS)


def test_the_registry_holds_the_types_by_their_ggml_names():
    assert {"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"} <= set(BLOCK_TYPES)
    for name, kind in BLOCK_TYPES.items():
        qtype = gguf.GGMLQuantizationType[name]  # (a GGML type name)
        assert kind.name == name and block_type(name) is kind
        assert (kind.elements, kind.block_bytes) == gguf.GGML_QUANT_SIZES[qtype]
        assert kind.bytes_per_weight == kind.block_bytes / kind.elements
        assert kind.elements % kind.group == 0 and kind.kernel in ("int4", "int8g") and kind.formula
        assert kind.medium_mix is None or kind.medium_mix in BLOCK_TYPES
    assert BLOCK_TYPES["Q4_K"].medium_mix == "Q6_K" and BLOCK_TYPES["Q8_0"].medium_mix is None  # (Q4_K_M)
    assert BLOCK_TYPES["Q4_0"].bytes_per_weight == 18 / 32 and BLOCK_TYPES["Q6_K"].bytes_per_weight == 210 / 256


def test_a_type_mili_does_not_run_is_refused_by_name():
    with pytest.raises(ValueError, match="IQ4_NL"):
        block_type("IQ4_NL")
    with pytest.raises(ValueError, match="IQ4_NL"):
        group_parts(np.zeros((16, 18), np.uint8), "IQ4_NL", (16, 32))


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_splits_into_exactly_gguf_dequantize(type_name):
    """float32 scale * q + offset per group is gguf-py's dequantize of the same blocks, bit for bit (a zero's sign
    aside where q is kept as q - zero: d (q - zero) and d q + (-0) may part there); q fits the type's bits."""
    kind = BLOCK_TYPES[type_name]
    _, parts, want = _parts(type_name)
    got = parts.dequantize().numpy()
    assert np.array_equal(got, want)  # (no tolerance)
    assert np.array_equal(got.view(np.int32)[want != 0], want.view(np.int32)[want != 0])
    assert parts.bits == kind.bits and parts.q.dtype == torch.int8 and parts.q.shape == (ROWS, COLS)
    assert parts.scales.shape == parts.offsets.shape == (ROWS, COLS // kind.group)
    symmetric = not parts.offsets.any()
    low, high = (-(1 << (kind.bits - 1)), (1 << (kind.bits - 1)) - 1) if symmetric else (0, (1 << kind.bits) - 1)
    assert low <= int(parts.q.min()) and int(parts.q.max()) <= high


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_runs_on_the_kernel_it_names(type_name):
    """The kernel format's choice for a type's parts (``cpu_form``, read from the parts) is the kernel the type
    names, with its bits above the nibble; where the CPU kernels are built, that layer's weights are gguf-py's."""
    from mili.kernels import cpu as cpu_kernels

    kind = BLOCK_TYPES[type_name]
    _, parts, want = _parts(type_name, seed=2)
    form = cpu_form(parts)
    assert form[0] == kind.kernel and form[3] == kind.group
    if kind.kernel == "int4":
        assert form[1] == kind.bits - 4  # (high bits)
    if not cpu_kernels.available():
        return
    layer = quantized_cpu_layer(parts, None, None)
    assert type(layer).__name__ == {"int4": "Int4Linear", "int8g": "Int8GroupLinear"}[kind.kernel]
    assert np.array_equal(layer.dequantize().numpy(), want)


def _tiny_gguf(folder: Path, types: dict[str, str] | str) -> tuple[Path, Path]:
    """(a GGUF file of a tiny random Qwen3, its matrices in ``types`` (write_gguf's), no tokenizer in it (the runs
    name the demo's: quicker), the HF checkpoint it was made from)."""
    from support.checkpoints import build_checkpoint

    checkpoint = build_checkpoint(folder / "hf", "gqa_untied", with_tokenizer=False, vocab_size=4096, hidden_size=256,
                                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64)
    return write_gguf(checkpoint, folder / "model.gguf", types, pre=None), checkpoint


def _llm(path: Path, dtype: str):
    from mili.model.demo import demo_checkpoint

    return LLM(str(path), dtype=dtype, tokenizer=demo_checkpoint())


def _greedy(llm, prompts, max_tokens=6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q5_1"])  # (test_gguf.py runs models of the others)
def test_a_model_stored_in_the_type_runs_as_stored(type_name, tmp_path):
    """A file of one type's tensors (gguf-py quantizes them): in float32 MILI's greedy tokens are HF's over gguf-py's
    dequantized tensors; on the CPU kernels each layer is on the type's kernel (Q4_1: int4 with its minimum as
    offsets, w = d q + m; Q5_0, Q5_1: with a bit above the nibble), whose weights are gguf-py's, value for value,
    and the tokens follow the float32 run's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    kind = BLOCK_TYPES[type_name]
    path, checkpoint = _tiny_gguf(tmp_path, type_name)
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} == {type_name, "F32"}
    reference = dequantized_state_dict([path], checkpoint)
    (tmp_path / "dequantized").mkdir()
    shutil.copy(checkpoint / "config.json", tmp_path / "dequantized" / "config.json")
    save_file({k: v.contiguous() for k, v in reference.items()}, tmp_path / "dequantized" / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).eval()
    prompts = [[11, 400, 7, 2901], [5, 17, 301, 42, 999, 3000, 12], [1234]]
    float32 = _llm(path, "float32")
    want = _greedy(float32, prompts)
    assert_greedy_matches_hf(want, hf_greedy(hf, prompts, 6), 6)
    llm = _llm(path, "bfloat16")
    if not llm.engine.plan.int8_kernels:  # (no int8 / int4 CPU kernels here: the blocks dequantized)
        return
    down, head = llm.apply_model(lambda m: (m.model.layers[1].mlp.down_proj, m.lm_head))
    for layer, name in ((down, "model.layers.1.mlp.down_proj.weight"), (head, "lm_head.weight")):
        assert type(layer).__name__ == "Int4Linear" and layer.high_bits == kind.bits - 4
        assert (layer.offsets is None) == (type_name == "Q5_0")  # (symmetric: none stored)
        assert torch.equal(layer.dequantize(), reference[name])
    got = _greedy(llm, prompts)
    assert sum(g.outputs[0].token_ids[0] == w.outputs[0].token_ids[0] for g, w in zip(got, want)) >= len(prompts) - 1
