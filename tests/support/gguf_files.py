"""GGUF files made from tiny HF checkpoints, as llama.cpp's convert_hf_to_gguf.py writes them: gguf-py's
``GGUFWriter`` and ``TensorNameMap`` for the names, the tokenizer's vocabulary and merges with gguf-py's
``SpecialVocab`` (special ids, chat template), and each weight in the block type asked. The types gguf-py
quantizes (Q8_0, Q4_0, Q4_1...) are quantized from the checkpoint's weights (``gguf.quants.quantize``); the
K-quants, which it cannot quantize, get random but valid blocks. The reference a test compares against is then
HF's model built from ``gguf.quants.dequantize`` of the file's own tensors (``dequantized_state_dict``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch




def _gguf():
    import gguf

    return gguf


ARCHS = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Qwen3NextForCausalLM": "qwen3next",
         "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe"}
HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")


def _type(name: str):
    return _gguf().GGMLQuantizationType[name]


def _random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of ``qtype`` for a [rows, cols] matrix: random quants and sub-block scales, and fp16
    super-block scales of the size a trained model's weights give (values of order 0.1)."""
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)

    def put(at: int, low: float, high: float):
        blocks[:, at:at + 2] = rng.uniform(low, high, size=len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)

    name = qtype.name
    if name in ("Q4_K", "Q5_K"):  # d, dmin first: w = d sc q - dmin m (sc, m 6 bits; q 4 or 5 bits)
        put(0, 2e-4, 6e-4)
        put(2, 2e-4, 1e-3)
    elif name == "Q6_K":  # d last: w = d sc (q - 32) (sc int8, q 6 bits)
        put(size - 2, 2e-4, 6e-4)
    else:
        raise ValueError(f"no random blocks for {name}")
    return blocks.reshape(rows, -1)


def encode_tensor(weight: np.ndarray, qtype_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    gguf = _gguf()
    qtype = _type(qtype_name)
    if qtype_name in ("F32", "F16", "BF16"):
        dtype = {"F32": np.float32, "F16": np.float16}.get(qtype_name)
        if dtype is None:
            return gguf.quants.quantize(weight.astype(np.float32), qtype), qtype
        return weight.astype(dtype), qtype
    try:  # (every type gguf-py quantizes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1...)
        return gguf.quants.quantize(weight.astype(np.float32), qtype), qtype
    except NotImplementedError:  # (the K-quants)
        pass
    rows = int(np.prod(weight.shape[:-1]))
    return _random_blocks(qtype, rows, weight.shape[-1], rng).reshape(*weight.shape[:-1], -1), qtype


def _tokenizer_metadata(writer, tokenizer_dir: Path, vocab_size: int, pre: str = "qwen2") -> None:
    """llama.cpp's BPE ("gpt2") vocabulary: every id up to the model's vocab size (unused ids as [PADn]
    user-defined tokens), added tokens as control or user-defined, then merges, special ids and the chat
    template from the tokenizer's own files."""
    from transformers import AutoTokenizer

    gguf = _gguf()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)


def write_gguf(checkpoint: Path, out: Path, types: dict[str, str] | str = "F32", seed: int = 0,
               split_max_tensors: int = 0, tokenizer_dir: Path | None = None, pre: str | None = "qwen2") -> Path:
    """``checkpoint`` (a Qwen3 or Qwen3 MoE folder) as a GGUF file ``out``. ``types``: one block type for
    every matrix, or {regex on the GGUF name: type} (first match; norms and the router stay F32, as llama.cpp
    keeps them). ``split_max_tensors``: write split files (-00001-of-0000N.gguf) of that many tensors."""
    from safetensors.torch import load_file

    gguf = _gguf()
    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    state = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(file))
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    writer.add_name(checkpoint.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    mtp = 1 if arch in HYBRID_ARCHS and any(n.startswith("mtp.") for n in state) else 0
    writer.add_block_count(layers + mtp)  # (llama.cpp's converter counts the MTP layer as a block)
    if "intermediate_size" in config:
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta"))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if config.get("num_experts") or config.get("num_local_experts"):
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if pre is not None:
        _tokenizer_metadata(writer, tokenizer_dir or checkpoint, config["vocab_size"], pre)

    hybrid = arch in HYBRID_ARCHS
    if hybrid:
        _hybrid_metadata(writer, arch, config, mtp)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers + mtp)
        state = dict(_llamacpp_hybrid_tensors(arch, config, state))
    rng = np.random.default_rng(seed)
    stacked: dict[str, list[tuple[int, torch.Tensor]]] = {}
    tensors: dict[str, np.ndarray] = {}
    sources: dict[str, list] = {}  # (hybrids) where each file tensor's values come from (_llamacpp_hybrid_tensors)
    for name, tensor in state.items():
        if hybrid:
            tensor, sources[name] = tensor
        expert = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if expert:  # one tensor per expert and projection: stacked, as llama.cpp stores them
            stacked.setdefault(f"{expert.group(1)}.{expert.group(3)}", []).append((int(expert.group(2)), tensor))
            continue
        tensors[name] = tensor.float().numpy()
    for stem, experts in stacked.items():
        tensors[f"{stem}.weight"] = torch.stack([t for _, t in sorted(experts, key=lambda e: e[0])]).float().numpy()
    rows: dict[str, list] = {}
    for name, value in tensors.items():
        gguf_name = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name}")
        qtype_name = "F32"
        if value.ndim >= 2 and not gguf_name.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight")):
            qtype_name = types if isinstance(types, str) else next(
                (t for pattern, t in types.items() if re.search(pattern, gguf_name)), "F32")
        if name in sources:  # (hybrids) where the reference finds this tensor's values
            how = sources[name]
            rows.setdefault(how[0], []).append([gguf_name, *how[1:]])
        data, qtype = encode_tensor(value, qtype_name, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    if hybrid:
        (out.parent / f"{out.name}.rows.json").write_text(json.dumps(rows))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _hybrid_metadata(writer, arch: str, config: dict, mtp: int) -> None:
    """The hybrids' keys, as llama.cpp's converter writes them (Qwen3NextModel and its subclasses)."""
    if mtp:
        writer.add_nextn_predict_layers(mtp)
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in config["layer_types"]] + [False] * mtp)
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    rope = config.get("rope_parameters") or {}
    writer.add_rope_dimension_count(int(config["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if config.get("num_experts"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    return mtp


def _llamacpp_hybrid_tensors(arch: str, config: dict, state: dict):
    """The checkpoint's tensors changed as llama.cpp's convert_hf_to_gguf.py changes them (conversion/qwen.py:
    Qwen3NextModel, _LinearAttentionVReorderBase, _QwenMtpMixin): yields (name for TensorNameMap, or the GGUF
    name itself, (tensor, how)). ``how`` tells the reference where the checkpoint's values went: [checkpoint
    name, rows, columns, op], rows / columns the checkpoint index of each one here (None: the same), op the
    change of value ("neg_exp": -exp(x), "plus_one": 1 + x, "squeeze": [C, 1, K] -> [C, K]); or [pattern with
    {e}, "stack"] for experts stacked."""
    layers = config["num_hidden_layers"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    hk, hv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    rep = nv // nk
    tiled = arch != "qwen3next" and nk != nv

    def tile(n: int, head_dim: int) -> torch.Tensor:  # _reorder_v_heads: grouped by key head -> tiled
        return torch.arange(n).view(nk, rep, head_dim).permute(1, 0, 2).reshape(-1)

    nextn = {"mtp.fc.weight": "eh_proj", "mtp.pre_fc_norm_embedding.weight": "enorm",
             "mtp.pre_fc_norm_hidden.weight": "hnorm", "mtp.norm.weight": "shared_head_norm"}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for source, tensor in state.items():
        name = source
        if name in nextn:
            name = f"blk.{layers}.nextn.{nextn[name]}.weight"
        elif name.startswith("mtp.layers.0."):
            name = name.replace("mtp.layers.0.", f"model.layers.{layers}.")
        expert = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if expert:
            experts.setdefault(f"{expert.group(1)}.{expert.group(3)}.weight", {})[int(expert.group(2))] = tensor
            continue
        rows = cols = op = None
        if ".conv1d." in name:  # (squeezed first, then its value channels tiled)
            tensor, op = tensor.squeeze(), "squeeze"
        if tiled and ".linear_attn." in name:
            qk = 2 * nk * hk
            if ".in_proj_qkv." in name or ".conv1d." in name:
                rows = torch.cat([torch.arange(qk), qk + tile(nv * hv, hv)])
            elif ".in_proj_z." in name:
                rows = tile(nv * hv, hv)
            elif ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
                rows = tile(nv, 1)
            elif ".out_proj." in name:
                cols = tile(nv * hv, hv)
        if name.endswith(".A_log"):
            tensor, op = -torch.exp(tensor), "neg_exp"
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor, op = tensor + 1, "plus_one"
        if ".in_proj_qkvz." in name:  # Qwen3-Next: [q k v z] per key head -> q | k | v of all heads, and z
            per = torch.arange(tensor.shape[0]).view(nk, -1).split([hk, hk, rep * hv, rep * hv], dim=1)
            qkv, z = torch.cat([p.reshape(-1) for p in per[:3]]), per[3].reshape(-1)
            base = name.removesuffix("in_proj_qkvz.weight")
            yield base + "in_proj_qkv.weight", (tensor[qkv], [source, qkv.tolist(), None, None])
            yield base + "in_proj_z.weight", (tensor[z], [source, z.tolist(), None, None])
            continue
        if rows is not None:
            tensor = tensor[rows]
        if cols is not None:
            tensor = tensor[:, cols]
        yield name, (tensor, [source, None if rows is None else rows.tolist(),
                              None if cols is None else cols.tolist(), op])
    for stem, by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        pattern = stem.replace(".mlp.experts.", ".mlp.experts.{e}.").replace(f"model.layers.{layers}.", "mtp.layers.0.")
        yield stem, (stacked, [pattern, "stack"])


def _dequantized_file_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF ``files`` by its GGUF name: ``gguf.quants.dequantize``, outermost dimension first."""
    gguf = _gguf()
    stored = {}
    for file in files:
        for t in gguf.GGUFReader(file).tensors:
            stored[t.name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(
                [int(d) for d in reversed(t.shape)])
    return stored


def dequantized_state_dict(files: list[Path], checkpoint: Path) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors as the GGUF files hold them: ``gguf.quants.dequantize`` of each, under the
    checkpoint's names (stacked experts split back into one tensor per expert)."""
    from safetensors import safe_open

    gguf = _gguf()
    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    if arch in HYBRID_ARCHS:
        return _hybrid_reference(files, checkpoint)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    stored = _dequantized_file_tensors(files)
    out = {}
    hf_names = []
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            hf_names += list(f.keys())
    for name in hf_names:
        expert = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if expert:
            gguf_name = names.get_name(f"{expert.group(1)}.{expert.group(3)}.weight", try_suffixes=(".weight",))
            out[name] = stored[gguf_name][int(expert.group(2))]
        else:
            out[name] = stored[names.get_name(name, try_suffixes=(".weight", ".bias"))]
    return out


def _hybrid_reference(files: list[Path], checkpoint: Path) -> dict[str, torch.Tensor]:
    """A hybrid checkpoint's tensors as the GGUF file holds them: ``gguf.quants.dequantize`` of each file tensor,
    put back where write_gguf recorded its values came from (rows and columns unmoved, experts unstacked, the
    converter's change of value reversed: log(-x) of -exp(A_log), x - 1 of a 1 + w norm, the conv unsqueezed)."""
    from safetensors import safe_open

    stored = _dequantized_file_tensors(files)
    shapes = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    out = {}
    for source, pieces in json.loads(Path(f"{files[0]}.rows.json").read_text()).items():
        for gguf_name, *how in pieces:
            value = stored[gguf_name]
            if how == ["stack"]:
                for e, expert in enumerate(value):
                    out[source.format(e=e)] = expert
                continue
            rows, cols, op = how
            value = {"neg_exp": lambda x: torch.log(-x), "plus_one": lambda x: x - 1}.get(op, lambda x: x)(value)
            full = out.setdefault(source, torch.zeros(shapes[source]).squeeze() if op == "squeeze" else
                                  torch.zeros(shapes[source]))
            if cols is not None:
                full[:, torch.tensor(cols)] = value
            elif rows is not None:
                full[torch.tensor(rows)] = value
            else:
                full.copy_(value)
    return {k: v.reshape(shapes[k]) for k, v in out.items()}


# The test models: the demo's tokenizer (4096 tokens, its chat template) over random Qwen3 weights whose matrices
# are multiples of 256 wide (the K-quants' super-blocks), each in one of llama.cpp's mixes
_DENSE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
Q4_K_M = {r"attn_v|ffn_down|output": "Q6_K", r"attn_[qko]|ffn_(gate|up)|token_embd": "Q4_K"}  # llama.cpp's mix
KINDS = {
    "q4_k_m": (_DENSE, Q4_K_M),
    "q8_0": ({**_DENSE, "head_dim": 32, "tie_word_embeddings": True}, "Q8_0"),  # head_dim != hidden / heads
    "q4_0": (_DENSE, {r"token_embd|output": "Q8_0", ".": "Q4_0"}),
    "q5_k": (_DENSE, {r"token_embd|output": "F16", ".": "Q5_K"}),
    "f16_bf16": (_DENSE, {r"attn": "F16", ".": "BF16"}),
    "moe": (dict(vocab_size=4096, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
            {r"ffn_(gate|up)_exps": "Q4_K", r"ffn_down_exps": "Q6_K", ".": "Q8_0"}),
}


def build_gguf_model(folder: Path, kind: str, split_max_tensors: int = 0) -> tuple[Path, Path]:
    """(the GGUF file of ``KINDS[kind]``, the HF checkpoint it was made from) in ``folder``."""
    from mili.model.demo import demo_checkpoint
    from support.checkpoints import build_checkpoint, build_moe_checkpoint

    shape, types = KINDS[kind]
    folder.mkdir(parents=True, exist_ok=True)
    if "num_experts" in shape:
        checkpoint = build_moe_checkpoint(folder / "hf", **shape)
    else:
        checkpoint = build_checkpoint(folder / "hf", "gqa_untied", with_tokenizer=False, **shape)
    demo = Path(demo_checkpoint())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo / name).is_file():
            (checkpoint / name).write_bytes((demo / name).read_bytes())
    return write_gguf(checkpoint, folder / f"{kind}.gguf", types, split_max_tensors=split_max_tensors), checkpoint


# The hybrids' test models: 3 Gated DeltaNet layers and 1 gated attention, 2 key heads for 8 value heads (llama.cpp
# tiles Qwen3.5's), matrices 256 wide, the MTP head; Qwen3-Next without a dense layer (llama.cpp has none)
HYBRID_SHAPE = dict(vocab_size=4096, hidden_size=256, head_dim=64, linear_key_head_dim=32, linear_num_value_heads=8,
                    linear_value_head_dim=32, intermediate_size=256, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256)
HYBRID_KINDS = {"qwen3_5": {}, "qwen3_5_moe": {}, "qwen3_next": {"mlp_only_layers": []}}
# a Q4_K_M-like mix; ssm_out stays F16 (llama.cpp moved its columns: its blocks could not be the checkpoint's)
HYBRID_Q4_K_M = {r"ssm_out": "F16", r"attn_v|ffn_down|output": "Q6_K", r"ssm_(alpha|beta|ba)|_shexp|nextn": "Q8_0",
                 r".": "Q4_K"}


def build_hybrid_gguf_model(folder: Path, kind: str, types: dict[str, str] | str = "F32") -> tuple[Path, Path]:
    """(the GGUF file of a hybrid ``kind`` (HYBRID_KINDS) with its MTP head, the HF checkpoint it was made from)."""
    from mili.model.demo import demo_checkpoint
    from support.hybrid import build_hybrid_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = build_hybrid_checkpoint(folder / "hf", kind, mtp=True, shape={**HYBRID_SHAPE, **HYBRID_KINDS[kind]})
    demo = Path(demo_checkpoint())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo / name).is_file():
            (checkpoint / name).write_bytes((demo / name).read_bytes())
    name = types if isinstance(types, str) else "mix"
    return write_gguf(checkpoint, folder / f"{kind}-{name}.gguf", types), checkpoint
