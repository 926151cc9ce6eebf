"""GGUF files, llama.cpp's and Ollama's format, read with gguf-py (``pip install gguf``).

A GGUF model is served as a checkpoint folder made from the file's metadata, in MILI's cache: ``config.json``
(transformers' own GGUF conversion of the config, completed where it leaves a field out), the tokenizer with its
chat template (transformers' GGUF tokenizer conversion), and ``gguf.json``, which names the file (or its split
parts). The rest of MILI reads that folder as any other; the weight loader sees ``gguf.json`` and reads the
tensors from the file (``GGUFWeights``): float types as they are, block types dequantized for the model's float
weights, and, where a kernel computes with them as stored, as quants with a scale and an offset per group
(``gguf_blocks``: one class a block type, behind one registry).

What MILI runs: the architectures ``qwen3`` and ``qwen3moe``, and the hybrids ``qwen3next``, ``qwen35`` and
``qwen35moe`` (with the MTP head where the file carries it); the types F32, F16, BF16 and the block types of
``gguf_blocks``' registry (``BLOCK_TYPES``). Anything else is refused by name before a weight loads.

The hybrids: transformers' GGUF conversion does not cover them, so their config is read here from the file's
``{arch}.*`` keys (``ssm.*`` for the Gated DeltaNet layers), and llama.cpp's converter's changes to the
tensors are undone as they load (``_to_checkpoint``): ``ssm_a`` holds -exp(A_log), the zero-centred norms hold
1 + w, ``ssm_conv1d`` is squeezed, Qwen3-Next's ``ssm_ba`` interleaves b and a per key head, and Qwen3.5's value
heads are tiled (``[v0 of each key head, v1 of each, ...]``) where HF groups them by key head.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from mili.errors import ModelLoadError
from mili.model.gguf_blocks import BLOCK_TYPES, group_parts

log = logging.getLogger("mili")

FORMAT_VERSION = "gguf-v3"  # bump when the derived folder's contents change, so stale ones are rebuilt
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
                 "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
HYBRIDS = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}  # (HF model types)
TILED_V_HEADS = ("qwen35", "qwen35moe")  # llama.cpp reorders their value heads (not Qwen3-Next's)
# Qwen3.5's pre-tokenizer (llama.cpp's "qwen35"): Qwen2's, with marks (\p{M}) kept in words
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
FLOAT_TYPES = ("F32", "F16", "BF16")  # (the block types: gguf_blocks' BLOCK_TYPES, by GGML type name)
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
INSTALL_HINT = "pip install gguf"


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ModelLoadError(f"GGUF files need gguf-py: {INSTALL_HINT}") from e
    return gguf


def gguf_files(model: str) -> list[Path] | None:
    """The GGUF file(s) ``model`` names: a .gguf file, the first part of a split set (``-00001-of-0000N.gguf``,
    every part then), or a folder holding one (and no config.json); None when it names none."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(path.glob("*.gguf"))
        firsts = [p for p in found if not _SPLIT.match(p.name) or _SPLIT.match(p.name)["part"] == "00001"]
        if not found:
            return None
        if len(firsts) > 1:
            raise ModelLoadError(f"{model!r} holds {len(firsts)} GGUF models ({', '.join(p.name for p in firsts)}): "
                                 "name the file")
        path = firsts[0]
    elif not (path.suffix == ".gguf" and path.is_file()):
        return None
    split = _SPLIT.match(path.name)
    if split is None:
        files = [path]
    else:
        count = int(split["count"])
        files = [path.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"the split GGUF model {path.name!r} lacks {', '.join(missing)}")
    for f in files:
        with open(f, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{f} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    return files


def _reader(file: Path):
    """The file's header (metadata and tensor table: mili.model.gguf_header, gguf-py's GGUFReader's surface)."""
    _gguf()  # (its tables; a clear error where gguf-py is not installed)
    from mili.model.gguf_header import read_header

    try:
        return read_header(file)
    except Exception as e:  # a truncated file, a bad header
        raise ModelLoadError(f"cannot read the GGUF file {file}: {type(e).__name__}: {e} (truncated or "
                             f"damaged?)") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def describe_types(counts: dict[str, int]) -> str:
    return ", ".join(f"{t} {n}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _inspect(files: list[Path]):
    """(arch, {tensor: type name}, {tensor: shape, outermost first}, the index: {tensor: [file, type name, shape,
    byte offset, bytes]}, the first file's reader, which holds the metadata); refuses an arch or type MILI doesn't
    run, and a file shorter than its tensors."""
    types, shapes, index, arch, readers = {}, {}, {}, None, []
    for i, file in enumerate(files):
        reader = _reader(file)
        readers.append(reader)
        arch = arch or _field(reader, "general.architecture")
        size = file.stat().st_size
        for t in reader.tensors:
            types[t.name] = t.tensor_type.name
            shapes[t.name] = tuple(int(d) for d in reversed(t.shape))
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(f"the GGUF file {file} is truncated: tensor {t.name} ends at byte "
                                     f"{t.data_offset + t.n_bytes}, the file at {size}")
            index[t.name] = [i, t.tensor_type.name, list(shapes[t.name]), int(t.data_offset), int(t.n_bytes)]
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"the GGUF architecture {arch!r} is not one MILI runs (it runs "
                             f"{', '.join(ARCHITECTURES)})")
    odd = sorted({t for t in types.values() if t not in FLOAT_TYPES and t not in BLOCK_TYPES})
    if odd:
        raise ModelLoadError(f"the GGUF file holds tensor types MILI does not run: {', '.join(odd)} (it holds "
                             f"{describe_types(Counter(types.values()))}; MILI runs "
                             f"{', '.join(FLOAT_TYPES + tuple(sorted(BLOCK_TYPES)))})")
    return arch, types, shapes, index, readers[0]


def prepare(files: list[Path]) -> str:
    """The checkpoint folder for GGUF ``files`` (made once, then reused while the files are unchanged)."""
    key = hashlib.sha256(json.dumps([FORMAT_VERSION] + [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                                                         for f in files]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("MILI_CACHE_DIR") or Path.home() / ".cache" / "mili").expanduser() / "gguf"
    final = root / f"{files[0].name.removesuffix('.gguf')}-{key}"
    if (final / "gguf.json").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        _write_folder(files, tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process made it first: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(final)


def _write_folder(files: list[Path], folder: Path) -> None:
    from transformers import AutoConfig

    arch, types, shapes, index, reader = _inspect(files)  # (one read of the metadata: ~0.3 s for a 150k vocabulary)
    embed = shapes.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"the GGUF file {files[0].name} has no token_embd.weight")
    tied = "output.weight" not in types
    if arch in HYBRIDS:
        fields, mtp_layers = _hybrid_config(arch, reader, embed[0], tied, files[0].name)
        model_type = HYBRIDS[arch]
    else:
        model_type, fields = _dense_config(arch, files[0], reader, embed[0], tied)
        mtp_layers = 0
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as e:
        raise ModelLoadError(f"the GGUF metadata of {files[0].name} does not make a {model_type} config: "
                             f"{type(e).__name__}: {e}") from e
    config.architectures = [ARCHITECTURES[arch]]
    config.dtype = "bfloat16"
    raw = config.to_dict()
    counts = Counter(types.values())
    raw["quantization_config"] = {"quant_method": "gguf", "file_type": _file_type(counts),
                                  "tensor_types": dict(counts)}
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    tokenizer_error = None
    try:
        tokenizer = _tokenizer(files[0], reader, arch)
    except ModelLoadError as e:  # (the folder is still a model: --tokenizer may name an HF tokenizer for it)
        tokenizer_error = str(e)
        log.warning("%s", e)
    else:
        template = _field(reader, "tokenizer.chat_template")
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        tokenizer.save_pretrained(folder)
        if _field(reader, "tokenizer.ggml.pre") == "qwen35":  # (Qwen2Tokenizer's class would put Qwen2's split back)
            spec = folder / "tokenizer_config.json"
            spec.write_text(json.dumps({**json.loads(spec.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"},
                                       indent=2))
    # the tensors' places in the files, so a load need not parse the metadata again (gguf-py reads a 150k-token
    # vocabulary's strings one by one: ~10 s)
    (folder / "gguf.json").write_text(json.dumps({"files": [str(f.resolve()) for f in files], "arch": arch,
                                                  "mtp_layers": mtp_layers, "tokenizer_error": tokenizer_error,
                                                  "tensors": index}))
    log.info("GGUF %s: %s, tensors %s", files[0].name, arch, describe_types(counts))


def _dense_config(arch: str, file: Path, reader, vocab: int, tied: bool) -> tuple[str, dict]:
    """(model type, config fields) of a qwen3 / qwen3moe file: transformers' own GGUF conversion (its tables, applied
    to the header already read: gguf_header.transformers_config), completed."""
    from mili.model.gguf_header import transformers_config

    try:
        fields = transformers_config(reader)
    except Exception as e:
        raise ModelLoadError(f"transformers cannot read the GGUF metadata of {file}: {type(e).__name__}: "
                             f"{e}") from e
    model_type = fields.pop("model_type")
    fields.pop("_model_name_or_path", None)
    # what transformers' conversion leaves out: the head size (Qwen3's is not hidden / heads), and llama.cpp's
    # qwen3moe always renormalizes the chosen experts' weights
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        fields["head_dim"] = int(head_dim)
    if arch == "qwen3moe":
        fields["norm_topk_prob"] = True
        fields.setdefault("moe_intermediate_size", _field(reader, f"{arch}.expert_feed_forward_length"))
        fields["decoder_sparse_step"], fields["mlp_only_layers"] = 1, []
    fields["tie_word_embeddings"] = tied
    fields["vocab_size"] = vocab
    return model_type, fields


def _hybrid_config(arch: str, reader, vocab: int, tied: bool, name: str) -> tuple[dict, int]:
    """(config fields, MTP layers) of a qwen3next / qwen35 / qwen35moe file, from its metadata as llama.cpp's
    converter writes it (block_count counts the MTP layers, ``nextn_predict_layers`` of them at the end)."""
    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"the GGUF file {name} lacks the metadata key {arch}.{key}")
        return value

    mtp = int(_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
    layers = int(need("block_count")) - mtp
    head_dim = int(need("attention.key_length"))
    value_heads = int(need("ssm.time_step_rank"))
    recurrent = _field(reader, f"{arch}.attention.recurrent_layers")
    interval = int(_field(reader, f"{arch}.full_attention_interval", 4))
    if recurrent is not None:
        layer_types = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    else:
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    fields = dict(
        vocab_size=vocab, hidden_size=int(need("embedding_length")), num_hidden_layers=layers,
        num_attention_heads=int(need("attention.head_count")), num_key_value_heads=int(need("attention.head_count_kv")),
        head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(need("rope.freq_base")),
                         "partial_rotary_factor": int(need("rope.dimension_count")) / head_dim},
        linear_conv_kernel_dim=int(need("ssm.conv_kernel")), linear_key_head_dim=int(need("ssm.state_size")),
        linear_num_key_heads=int(need("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_value_head_dim=int(need("ssm.inner_size")) // value_heads, layer_types=layer_types,
        full_attention_interval=interval, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    ffn = _field(reader, f"{arch}.feed_forward_length")
    if ffn:
        fields["intermediate_size"] = int(ffn)
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        fields.update(num_experts=int(experts), num_experts_per_tok=int(need("expert_used_count")),
                      moe_intermediate_size=int(need("expert_feed_forward_length")),
                      shared_expert_intermediate_size=int(need("expert_shared_feed_forward_length")))
    if arch == "qwen3next":  # (every layer MoE, the chosen experts' weights renormalized, as llama.cpp runs it)
        fields.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if mtp:
        fields["mtp_num_hidden_layers"] = mtp
    return fields, mtp


def _tokenizer(file: Path, reader, arch: str):
    """The tokenizer, by transformers' GGUF conversion. It converts a tokenizer for the archs whose config it
    converts, so for the hybrids the file's ``tokenizer.*`` keys are copied into a file of arch qwen3 (the same
    BPE vocabulary kind) and converted from there; llama.cpp's "qwen35" pre-tokenizer then gets its own split."""
    # (Qwen's tokenizer class by name: AutoTokenizer would first rebuild the file's model config, which for qwen3
    # parses the whole file again with gguf's reader, ~13 s of a 150k vocabulary's first load; the class alone reads
    # just the tokenizer keys, ~1 s). Qwen2TokenizerFast: the class AutoTokenizer picks in transformers 4, an alias of
    # Qwen2Tokenizer in 5.
    from transformers import Qwen2TokenizerFast

    try:
        if arch not in HYBRIDS:
            tokenizer = Qwen2TokenizerFast.from_pretrained(str(file.parent), gguf_file=file.name)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                _copy_tokenizer_keys(reader, Path(tmp) / "tokenizer.gguf")
                tokenizer = Qwen2TokenizerFast.from_pretrained(tmp, gguf_file="tokenizer.gguf")
    except Exception as e:
        raise ModelLoadError(f"transformers cannot build the tokenizer of {file}: {type(e).__name__}: {e} "
                             "(or pass --tokenizer with an HF tokenizer)") from e
    if _field(reader, "tokenizer.ggml.pre") == "qwen35":
        from tokenizers import Regex, pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer


def _copy_tokenizer_keys(reader, out: Path) -> None:
    gguf = _gguf()
    writer = gguf.GGUFWriter(out, "qwen3")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def _file_type(counts: Counter) -> str:
    """A name for the mix (llama.cpp's file types by their main block type: NAME_M where the file holds the type
    that type's "_M" mix adds, ``BlockType.medium_mix``)."""
    blocks = {t: n for t, n in counts.items() if t in BLOCK_TYPES}
    if not blocks:
        return max(counts, key=counts.get) if counts else "F32"
    main = max(blocks, key=blocks.get)
    return f"{main}_M" if BLOCK_TYPES[main].medium_mix in blocks else main


def gguf_folder_files(path: str) -> list[str] | None:
    """The GGUF files behind a folder ``prepare`` made, or None for any other folder."""
    spec = Path(path) / "gguf.json"
    if not spec.is_file():
        return None
    return json.loads(spec.read_text())["files"]


def tokenizer_error(folder: str) -> str | None:
    """Why the GGUF model's metadata made no tokenizer (None: it made one, or the folder is no GGUF model's)."""
    spec = Path(folder) / "gguf.json"
    return json.loads(spec.read_text()).get("tokenizer_error") if spec.is_file() else None


def checkpoint_names(folder: str) -> list[str]:
    """The checkpoint names of a GGUF model's tensors (the folder ``prepare`` made), read from its index."""
    spec = json.loads((Path(folder) / "gguf.json").read_text())
    config = json.loads((Path(folder) / "config.json").read_text())
    names = hf_names(spec["arch"], config["num_hidden_layers"], config.get("num_experts", 0) or 0,
                     spec.get("mtp_layers", 0))
    return [names[t] for t in spec["tensors"] if t in names]


class _Tensor:
    """One tensor of the index, its data memory-mapped: float types typed, block types as bytes [rows, bytes]."""

    def __init__(self, name: str, type_name: str, shape: list[int], data):
        self.name, self.type_name, self.shape, self.data = name, type_name, tuple(shape), data
        self.tensor_type = _gguf().GGMLQuantizationType[type_name]


_LAYER_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj")
_MOE_NAMES = ("mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
_HYBRID_NAMES = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                 "linear_attn.in_proj_ba", "linear_attn.conv1d", "linear_attn.A_log",
                 "linear_attn.norm", "linear_attn.out_proj", "mlp.shared_expert.gate_proj",
                 "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert_gate")
# the MTP head's own tensors (llama.cpp's nextn.*, at the first MTP block) and their checkpoint names
_NEXTN = {"eh_proj": "mtp.fc.weight", "enorm": "mtp.pre_fc_norm_embedding.weight",
          "hnorm": "mtp.pre_fc_norm_hidden.weight", "shared_head_norm": "mtp.norm.weight"}


def hf_names(arch: str, num_layers: int, num_experts: int, mtp_layers: int = 0) -> dict[str, str]:
    """{GGUF tensor name: the checkpoint name MILI's loader takes}, for every tensor a model of ``arch`` has
    (gguf-py's TensorNameMap, read backwards); stacked experts map to their stem (split per expert on load);
    the MTP blocks (after the model's) map to ``mtp.*``."""
    gguf = _gguf()
    blocks = num_layers + mtp_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], blocks)
    hybrid = arch in HYBRIDS
    out = {}
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        out[names.get_name(name, try_suffixes=(".weight",))] = name
    for i in range(blocks):
        p = f"model.layers.{i}"
        stems = _LAYER_NAMES + (_MOE_NAMES if num_experts else ()) + (_HYBRID_NAMES if hybrid else ())
        mine = {}
        for stem in stems:
            name = f"{p}.{stem}" + ("" if stem.endswith("A_log") else ".weight")
            gguf_name = names.get_name(name, try_suffixes=(".weight",))
            if gguf_name is not None:
                mine[gguf_name] = name
        if hybrid:
            mine[f"blk.{i}.ssm_dt.bias"] = f"{p}.linear_attn.dt_bias"
        if i >= num_layers:  # an MTP block: its layer under mtp.layers.{j}, and the head's own tensors
            mine = {g: n.replace(f"{p}.", f"mtp.layers.{i - num_layers}.") for g, n in mine.items()}
            if i == num_layers:
                mine.update({f"blk.{i}.nextn.{k}.weight": v for k, v in _NEXTN.items()})
        out.update(mine)
    out.pop(None, None)
    return out


def _untile(n: int, num_k_heads: int, head_dim: int):
    """For each of ``n`` value rows in HF's order (grouped by key head: [k0's v0, v1, .., k1's v0, ..]) the row
    that holds it in llama.cpp's tiled order ([v0 of each key head, v1 of each, ..])."""
    import torch

    return torch.arange(n).view(n // (num_k_heads * head_dim), num_k_heads, head_dim).permute(1, 0, 2).reshape(-1)


class GGUFWeights:
    """The tensors of a GGUF model (the folder ``prepare`` made), memory-mapped from its files by the index there;
    ``names`` maps each GGUF name to the checkpoint name MILI's loader takes."""

    def __init__(self, folder: str, num_layers: int, num_experts: int):
        import numpy as np

        gguf = _gguf()
        spec = json.loads((Path(folder) / "gguf.json").read_text())
        self.arch = arch = spec["arch"]
        self.config = json.loads((Path(folder) / "config.json").read_text())
        self.names = hf_names(arch, num_layers, num_experts, spec.get("mtp_layers", 0))
        maps = []
        for f in spec["files"]:
            try:
                maps.append(np.memmap(f, dtype=np.uint8, mode="r"))
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"cannot read the GGUF file {f}: {e}") from e
        self.tensors = {}
        for name, (i, type_name, shape, offset, n_bytes) in spec["tensors"].items():
            raw = maps[i][offset:offset + n_bytes]
            if raw.size != n_bytes:
                raise ModelLoadError(f"the GGUF file {spec['files'][i]} is truncated (tensor {name})")
            qtype = gguf.GGMLQuantizationType[type_name]
            if type_name in ("F32", "F16"):
                data = raw.view(np.float32 if type_name == "F32" else np.float16).reshape(shape)
            else:
                data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(tuple(shape), qtype))
            self.tensors[name] = _Tensor(name, type_name, shape, data)
        self.types = Counter(t.type_name for t in self.tensors.values())
        unknown = sorted(n for n in self.tensors if n not in self.names)
        if unknown:
            raise ModelLoadError(f"the GGUF file has tensors a {arch} model of {num_layers} layers has not: "
                                 f"{unknown[:5]}")

    def shape(self, gguf_name: str) -> tuple[int, ...]:
        return self.tensors[gguf_name].shape

    def type_name(self, gguf_name: str) -> str:
        return self.tensors[gguf_name].type_name

    def dequantized(self, gguf_name: str):
        """The tensor in float32 as gguf-py dequantizes it."""
        import numpy as np
        import torch

        gguf = _gguf()
        t = self.tensors[gguf_name]
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"GGUF tensor {gguf_name} ({t.type_name} {t.shape}) cannot be read: {e}") from e
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(t.shape))

    def group_parts(self, gguf_name: str):
        """A block-typed matrix as quants with a scale and an offset per group (``gguf_blocks.group_parts``)."""
        t = self.tensors[gguf_name]
        return group_parts(t.data, t.type_name, t.shape)

    def items(self, keep_quantized: bool):
        """Each tensor as the checkpoint MILI loads would hold it: (GGUF name, checkpoint name, float32 tensor,
        its ``GroupParts`` or None). ``keep_quantized``: the parts of block-typed matrices too (a stacked expert's
        alone, see ``_experts``; none for a matrix whose columns llama.cpp moved). The converter's changes are
        undone (module docstring); a tied head gets the token table's parts as ``lm_head.weight``."""
        tied = self.config.get("tie_word_embeddings", False)
        for gguf_name, stem in self.names.items():
            if gguf_name not in self.tensors:
                continue
            if len(self.shape(gguf_name)) == 3 and ".mlp.experts." in stem:  # stacked: one tensor a expert
                yield from self._experts(gguf_name, stem, keep_quantized)
                continue
            tensor = self.dequantized(gguf_name)
            parts = None
            if keep_quantized and self.type_name(gguf_name) in BLOCK_TYPES and tensor.dim() == 2:
                parts = self.group_parts(gguf_name)
            if stem == "model.embed_tokens.weight":  # the head reads the table's blocks as stored, as llama.cpp's
                if parts is not None and tied:
                    yield gguf_name, "lm_head.weight", None, parts
                yield gguf_name, stem, tensor, None
            elif self.arch in HYBRIDS:
                yield from ((gguf_name, *found) for found in self._to_checkpoint(stem, tensor, parts))
            else:
                yield gguf_name, stem, tensor, parts

    def _experts(self, gguf_name: str, stem: str, keep_quantized: bool):
        """A stacked expert tensor, one expert at a time: with ``keep_quantized`` a block type's parts alone, made
        when asked (a callable: the CPU's expert layers are made from them one expert at a time, and the model's
        stacked float weights are left unwritten), else dequantized."""
        from functools import partial

        t = self.tensors[gguf_name]
        prefix, proj = stem.removesuffix(".weight").rsplit(".", 1)
        keep = keep_quantized and t.type_name in BLOCK_TYPES
        tensor = None if keep else self.dequantized(gguf_name)
        for e in range(t.shape[0]):
            name = f"{prefix}.{e}.{proj}.weight"
            if keep:
                yield gguf_name, name, None, partial(group_parts, t.data[e], t.type_name, t.shape[1:])
            else:
                yield gguf_name, name, tensor[e], None

    def _to_checkpoint(self, stem: str, tensor, parts):
        """A hybrid's tensor with llama.cpp's converter's changes undone: (checkpoint name, tensor, parts)."""
        import torch

        cfg = self.config
        nk, hk, hv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        nv = cfg["linear_num_value_heads"]
        tiled = self.arch in TILED_V_HEADS and nk != nv
        last = stem.rsplit(".", 2)[-2] if stem.endswith((".weight", ".bias")) else stem.rsplit(".", 1)[-1]

        def rows(index):
            return tensor[index], None if parts is None else parts.take_rows(index)

        if "norm" in last and not stem.endswith(".linear_attn.norm.weight"):  # zero-centred: the file holds 1 + w
            yield stem, tensor - 1, None
        elif last == "A_log":  # the file holds -exp(A_log)
            a = tensor[_untile(nv, nk, 1)] if tiled else tensor
            yield stem, torch.log(-a), None
        elif last == "dt_bias":
            yield stem, tensor[_untile(nv, nk, 1)] if tiled else tensor, None
        elif last == "conv1d":  # [channels, kernel] of q | k | v -> [channels, 1, kernel]
            if tiled:
                qk = 2 * nk * hk
                tensor = torch.cat([tensor[:qk], tensor[qk:][_untile(nv * hv, nk, hv)]])
            yield stem, tensor.unsqueeze(1), None
        elif last == "in_proj_qkv" and tiled:
            qk = 2 * nk * hk
            yield (stem, *rows(torch.cat([torch.arange(qk), qk + _untile(nv * hv, nk, hv)])))
        elif last == "in_proj_z" and tiled:
            yield (stem, *rows(_untile(nv * hv, nk, hv)))
        elif last in ("in_proj_a", "in_proj_b") and tiled:
            yield (stem, *rows(_untile(nv, nk, 1)))
        elif last == "in_proj_ba":  # Qwen3-Next's: [b of the group's value heads, a of them] per key head
            rep = nv // nk
            order = torch.arange(2 * nv).view(nk, 2, rep)
            base = stem.removesuffix("in_proj_ba.weight")
            yield (base + "in_proj_b.weight", *rows(order[:, 0].reshape(-1)))
            yield (base + "in_proj_a.weight", *rows(order[:, 1].reshape(-1)))
        elif last == "out_proj" and tiled:  # columns moved: dequantized (the blocks run along them)
            yield stem, tensor[:, _untile(nv * hv, nk, hv)], None
        else:
            yield stem, tensor, parts
