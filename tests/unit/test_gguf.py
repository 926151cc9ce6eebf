"""GGUF files (model/gguf.py): made here from tiny HF checkpoints with gguf-py's writer (support/gguf_files.py), in
each block type MILI maps onto its kernels. The reference is HF transformers' model built from gguf-py's own
``dequantize`` of the same tensors; bad files are refused by name at load."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import gguf  # noqa: E402
from mili import LLM, SamplingParams  # noqa: E402
from mili.errors import ModelLoadError  # noqa: E402
from mili.model.gguf_blocks import group_parts  # noqa: E402
from mili.model.quant import concat_parts  # noqa: E402
from mili.runtime.plan import StepKind  # noqa: E402
from support.checkpoints import QWEN3_TOKENIZER, build_checkpoint  # noqa: E402
from support.engine_state import assert_drained, runner_parts  # noqa: E402
from support.gguf_files import build_gguf_model, dequantized_state_dict, encode_tensor, write_gguf  # noqa: E402
from support.parity import assert_greedy_matches_hf, hf_greedy  # noqa: E402

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def _prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


def _hf_reference(files, checkpoint, prompts, tmp_path):
    """HF's model over gguf-py's dequantized tensors (saved as the checkpoint's safetensors, loaded by
    ``from_pretrained`` as any checkpoint): greedy tokens and raw scores per prompt."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "dequantized"
    folder.mkdir()
    shutil.copy(checkpoint / "config.json", folder / "config.json")
    save_file({k: v.contiguous() for k, v in dequantized_state_dict(files, checkpoint).items()},
              folder / "model.safetensors")
    return hf_greedy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), prompts, MAX_TOKENS)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_each_block_type_splits_into_exactly_gguf_dequantize(type_name):
    """scale * q + offset per group, in float32, is gguf-py's dequantize of the same blocks, value for value (bit for
    bit but Q4_0's zeros' signs); the K-quants keep their scales' two levels too (fp16 d, -dmin per super-block of 256,
    int8 sc, m per group), whose products are those scales and offsets."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.2, size=(48, 512)).astype(np.float32)
    data, qtype = encode_tensor(w, type_name, rng)
    parts = group_parts(data, type_name, (48, 512))
    want = gguf.quants.dequantize(data, qtype).reshape(48, 512)
    assert np.array_equal(parts.dequantize().numpy(), want)  # (no tolerance)
    if type_name != "Q4_0":
        assert np.array_equal(parts.dequantize().numpy().view(np.int32), want.view(np.int32))
    assert parts.bits == {"Q4_0": 4, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}[type_name]
    k_quant = type_name.endswith("_K")
    assert (parts.scales_k is not None) == k_quant and (parts.offsets_k is not None) == (type_name in ("Q4_K", "Q5_K"))
    if k_quant:
        assert parts.scales_k.d.shape == (48, 2) and parts.scales_k.sc.dtype == torch.int8
        assert torch.equal(parts.scales_k.d.half().float(), parts.scales_k.d)  # (fp16 values)
        assert torch.equal(parts.scales_k.values(), parts.scales)
        if parts.offsets_k is not None:
            assert torch.equal(parts.offsets_k.values(), parts.offsets) and parts.offsets_k.sc.min() >= 0
    if parts.bits == 4:
        low, high = (-8, 7) if type_name == "Q4_0" else (0, 15)  # (Q4_0: symmetric, no offsets)
        assert low <= parts.q.min() and parts.q.max() <= high and (type_name != "Q4_0" or not parts.offsets.any())
    # shards of one fused layer in two types (Q4_K_M's q and v): joined at the smaller group, the wider quants
    other = group_parts(*encode_tensor(w[:16], "Q6_K", rng)[:1], "Q6_K", (16, 512))
    joined = concat_parts([parts, other])
    assert torch.equal(joined.dequantize(), torch.cat([parts.dequantize(), other.dequantize()]))
    assert (joined.scales_k is not None) == k_quant  # (a K-quant beside a K-quant: still two levels)
    if k_quant:
        assert torch.equal(joined.scales_k.values(), joined.scales)
        assert joined.offsets_k is None if parts.offsets_k is None else torch.equal(joined.offsets_k.values(),
                                                                                   joined.offsets)


@pytest.mark.parametrize("kind", ["q4_k_m", "q8_0", "q4_0", "q5_k", "f16_bf16", "moe"])
def test_float32_greedy_matches_hf_on_the_dequantized_tensors(gguf_model, kind, tmp_path):
    path, checkpoint = gguf_model(kind)
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32")
    assert "gguf" in llm.engine.plan.weight_format
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outs, _hf_reference([path], checkpoint, prompts, tmp_path), MAX_TOKENS)
    assert_drained(llm)


def _gguf_dequantized(path, *names):
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    return torch.cat([torch.from_numpy(gguf.quants.dequantize(tensors[n].data, tensors[n].tensor_type)).reshape(
        [int(d) for d in reversed(tensors[n].shape)]) for n in names])


def test_bf16_runs_the_blocks_on_the_kernels_as_stored(gguf_model):
    """On MILI's CPU kernels the blocks compute as stored: Q4_K on the int4 kernel, Q6_K on it with its two bits above
    the nibble, whose dequantized weights are gguf-py's; the fused decode step takes both. The tokens follow the
    float32 run's (the kernels quantize activations: within their error)."""
    from mili.kernels import cpu as cpu_kernels
    from mili.model.cpu_linear import Int4Linear, SplitLinear

    path, _ = gguf_model("q4_k_m")
    llm = LLM(str(path), dtype="bfloat16")
    if not llm.engine.plan.int8_kernels:  # (AVX-512 without VNNI: the blocks dequantized, on the bf16 kernel)
        assert "dequantized to bfloat16" in llm.engine.plan.weight_format, llm.engine.plan.weight_format
        return
    assert "on the int4 and int8 kernels" in llm.engine.plan.weight_format
    gate_up, down, head = llm.apply_model(lambda m: (m.model.layers[0].mlp.gate_up_proj, m.model.layers[0].mlp.down_proj,
                                                     m.lm_head))
    assert all(isinstance(layer, Int4Linear) for layer in (gate_up, down, head))
    assert (gate_up.high_bits, down.high_bits, head.high_bits) == (0, 2, 2)  # (Q4_K; Q6_K: d sc (q - 32), q 6 bits)
    # their scales as the file stores them, in two levels (kernels.c's SCALES_K): fp16 d per 256, int8 sc per group
    assert all(layer.scales.dtype == torch.uint8 for layer in (gate_up, down, head))
    assert torch.equal(gate_up.dequantize(), _gguf_dequantized(path, "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"))
    assert torch.equal(down.dequantize(), _gguf_dequantized(path, "blk.0.ffn_down.weight"))
    assert torch.equal(head.dequantize(), _gguf_dequantized(path, "output.weight"))
    assert llm.engine.plan.step is StepKind.CPU_DECODE and cpu_kernels.available()
    # q and k Q4_K beside a Q6_K v: split, q|k on the int4 kernel, v on it with two high bits, each as stored
    qkv = llm.apply_model(lambda m: m.model.layers[0].self_attn.qkv_proj)
    assert isinstance(qkv, SplitLinear) and [p.high_bits for p in qkv.parts] == [0, 2]
    assert all(p.scales.dtype == torch.uint8 for p in qkv.parts)
    runner = runner_parts(llm).cpu_decode
    first = runner.layers[0]
    assert first.qkv.scale_mode == first.gate_up.scale_mode == 2 and first.qkv.next.contents.high_bits == 2
    assert torch.equal(qkv.dequantize(), _gguf_dequantized(path, *(f"blk.0.attn_{p}.weight" for p in "qkv")))
    # the fused decode layer runs these layers as the modules do, bit for bit
    eager = LLM(str(path), dtype="bfloat16", enforce_eager=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=5)]
    fused_out, eager_out = (e.generate(prompts, GREEDY, use_tqdm=False) for e in (llm, eager))
    for a, b in zip(fused_out, eager_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == \
            [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
    float32 = LLM(str(path), dtype="float32")
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want_tokens = [o.outputs[0].token_ids for o in float32.generate(prompts, params, use_tqdm=False)]
    assert sum(g[0] == w[0] for g, w in zip(got, want_tokens)) >= len(prompts) - 1


def test_split_files_and_a_folder_holding_one(gguf_model, tmp_path):
    path, checkpoint = gguf_model("q8_0")
    split, _ = build_gguf_model(tmp_path / "split", "q8_0", split_max_tensors=10)
    parts = sorted((tmp_path / "split").glob("*.gguf"))
    assert len(parts) > 1 and parts[0].name.endswith("-00001-of-%05d.gguf" % len(parts))
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    want = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32").generate(prompts, GREEDY,
                                                                                    use_tqdm=False)]
    for model in (parts[0], tmp_path / "split"):
        got = LLM(str(model), dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    parts[-1].unlink()
    with pytest.raises(ModelLoadError, match="lacks .*-of-"):
        LLM(str(parts[0]))


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    """The real Qwen3 tokenizer through GGUF metadata and transformers' conversion: the same ids for a
    multilingual text, the same text back, the same chat template."""
    from transformers import AutoTokenizer

    from mili.model.checkpoint import resolve_model_path

    checkpoint = build_checkpoint(tmp_path / "hf", "gqa4_realvocab")
    path = write_gguf(checkpoint, tmp_path / "real.gguf", "F16", tokenizer_dir=QWEN3_TOKENIZER)
    folder = resolve_model_path(str(path))
    ours, theirs = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    text = "Hello, world! Grüße aus Köln. 你好，世界。こんにちは 🌍 مرحبا بالعالم — «naïve» café\n\tx = 1 + 2"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(theirs.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    config = json.loads((tmp_path / "real.gguf").parent.joinpath(folder, "config.json").read_text())
    assert config["head_dim"] == 16 and config["quantization_config"]["tensor_types"]["F16"] > 0


def _copy(path, tmp_path, name="m.gguf"):
    out = tmp_path / name
    shutil.copy(path, out)
    return out


def test_bad_files_are_refused_by_name(gguf_model, tmp_path):
    path, checkpoint = gguf_model("q8_0")
    truncated = _copy(path, tmp_path, "truncated.gguf")
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated|cannot read"):
        LLM(str(truncated))
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGUX" + path.read_bytes()[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(str(wrong))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        _copy(path, tmp_path / "two", name)
    with pytest.raises(ModelLoadError, match="holds 2 GGUF models"):
        LLM(str(tmp_path / "two"))


def _rewrite(path, out, arch=None, shape_of=None, type_of=None):
    """A copy of GGUF ``path`` with its architecture renamed, one tensor's shape changed, or one tensor stored in
    another type (random blocks of it)."""
    reader = gguf.GGUFReader(path)
    arch_name = arch or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch_name)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name.startswith(reader.fields["general.architecture"].contents() + "."):
            name = arch_name + field.name[field.name.index("."):]
        else:
            name = field.name
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data, qtype = np.array(t.data), t.tensor_type
        if t.name == shape_of:
            data = data[:-1]
        if t.name == type_of:
            rows = int(t.shape[1])
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
            data = np.random.default_rng(0).integers(0, 255, (rows, int(t.shape[0]) // block * size), dtype=np.uint8)
            qtype = gguf.GGMLQuantizationType.IQ4_NL
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unknown_arch_odd_types_and_wrong_shapes(gguf_model, tmp_path):
    path, _ = gguf_model("q8_0")
    with pytest.raises(ModelLoadError, match="architecture 'llama' is not one MILI runs"):
        LLM(str(_rewrite(path, tmp_path / "llama.gguf", arch="llama")))
    with pytest.raises(ModelLoadError, match=r"types MILI does not run: IQ4_NL .*Q8_0 \d+.*MILI runs F32"):
        LLM(str(_rewrite(path, tmp_path / "iq.gguf", type_of="blk.0.attn_q.weight")))
    with pytest.raises(ModelLoadError, match="blk.1.ffn_up.weight"):
        LLM(str(_rewrite(path, tmp_path / "shape.gguf", shape_of="blk.1.ffn_up.weight")))


@pytest.mark.parametrize("kind,layer", [("q8_0", "Int8GroupLinear"), ("q4_0", "Int4Linear"),
                                        ("q5_k", "Int4Linear")])
def test_each_type_on_its_kernel_is_gguf_dequantize(gguf_model, kind, layer):
    path, _ = gguf_model(kind)
    llm = LLM(str(path), dtype="bfloat16")
    if not llm.engine.plan.int8_kernels:  # (AVX-512 without VNNI: dequantized, on the bf16 kernel)
        return
    down = llm.apply_model(lambda m: m.model.layers[1].mlp.down_proj)
    assert type(down).__name__ == layer and (down.offsets is None) == (kind != "q5_k")  # (symmetric types: none)
    assert torch.equal(down.dequantize(), _gguf_dequantized(path, "blk.1.ffn_down.weight"))
    if kind == "q8_0":  # tied: the head reads the token table's blocks as stored, as llama.cpp's does
        head = llm.apply_model(lambda m: m.lm_head)
        assert type(head).__name__ == "Int8GroupLinear"
        assert torch.equal(head.dequantize(), _gguf_dequantized(path, "token_embd.weight"))
    out = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in out)
    assert_drained(llm)


def test_a_file_without_a_tokenizer_takes_one_from_the_tokenizer_option(gguf_model, tmp_path):
    """A file whose metadata makes no tokenizer is refused by name, pointing at --tokenizer; with an HF tokenizer
    named there it serves (vLLM's --tokenizer)."""
    from mili.model.demo import demo_checkpoint

    _, checkpoint = gguf_model("q8_0")
    path = write_gguf(checkpoint, tmp_path / "bare.gguf", "Q8_0", pre=None)
    with pytest.raises(ModelLoadError, match="--tokenizer"):
        LLM(str(path))
    llm = LLM(str(path), dtype="float32", tokenizer=demo_checkpoint())
    out = llm.generate(["In the beginning"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text


def test_moe_experts_run_as_stored(gguf_model):
    """A MoE file's stacked experts (Q4_K gate and up, Q6_K down) become one kernel layer per expert, made from the
    blocks as stored (the model's stacked bf16 weights are never written): each expert's weights are gguf-py's
    dequantize of its slice, and the run follows the float32 one."""
    from mili.model.cpu_linear import Int4Linear

    path, _ = gguf_model("moe")
    llm = LLM(str(path), dtype="bfloat16")
    if not llm.engine.plan.int8_kernels:  # (AVX-512 without VNNI: the blocks dequantized, on the bf16 kernel)
        return
    experts = llm.apply_model(lambda m: m.model.layers[1].mlp.experts)
    assert experts.w13 is None and len(experts.linears) == 2 * experts.num_experts
    stacked = {n: _gguf_dequantized(path, f"blk.1.ffn_{n}_exps.weight").reshape(experts.num_experts, -1, 256)
               for n in ("gate", "up")}
    down = _gguf_dequantized(path, "blk.1.ffn_down_exps.weight").reshape(experts.num_experts, 256, -1)
    for e in (0, experts.num_experts - 1):
        gate_up, down_layer = experts.linears[2 * e], experts.linears[2 * e + 1]
        assert isinstance(gate_up, Int4Linear) and isinstance(down_layer, Int4Linear) and down_layer.high_bits == 2
        assert torch.equal(gate_up.dequantize(), torch.cat([stacked["gate"][e], stacked["up"][e]]))
        assert torch.equal(down_layer.dequantize(), down[e])
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32").generate(prompts, params, use_tqdm=False)]
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= len(prompts) - 1
    assert_drained(llm)
