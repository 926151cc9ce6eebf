"""GGUF files, llama.cpp's and Ollama's format, read with gguf-py (``pip install gguf``).

A GGUF model is served as a checkpoint folder made from the file's metadata, in MILI's cache: ``config.json``
(transformers' own GGUF conversion of the config, completed where it leaves a field out), the tokenizer with its
chat template (transformers' GGUF tokenizer conversion), and ``gguf.json``, which names the file (or its split
parts). The rest of MILI reads that folder as any other; the weight loader sees ``gguf.json`` and reads the
tensors from the file (``GGUFWeights``): float types as they are, block types dequantized for the model's float
weights, and, where a kernel computes with them as stored, as quants with a scale and an offset per group
(``gguf_blocks.py``).

What MILI runs: the architectures ``qwen3`` and ``qwen3moe``; the types F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K
and Q6_K. Anything else is refused by name before a weight loads.
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

log = logging.getLogger("mili")

FORMAT_VERSION = "gguf-v2"  # bump when the derived folder's contents change, so stale ones are rebuilt
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
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
    gguf = _gguf()
    try:
        return gguf.GGUFReader(file)
    except Exception as e:  # a truncated file, a bad header: gguf-py raises what numpy does
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
    odd = sorted({t for t in types.values() if t not in FLOAT_TYPES + BLOCK_TYPES})
    if odd:
        raise ModelLoadError(f"the GGUF file holds tensor types MILI does not run: {', '.join(odd)} (it holds "
                             f"{describe_types(Counter(types.values()))}; MILI runs "
                             f"{', '.join(FLOAT_TYPES + BLOCK_TYPES)})")
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
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch, types, shapes, index, reader = _inspect(files)  # (one parse of the metadata: ~10 s for a 150k vocabulary)
    try:
        parsed = load_gguf_checkpoint(str(files[0]), return_tensors=False)
    except Exception as e:
        raise ModelLoadError(f"transformers cannot read the GGUF metadata of {files[0]}: {type(e).__name__}: "
                             f"{e}") from e
    fields = dict(parsed["config"])
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
    fields["tie_word_embeddings"] = "output.weight" not in types
    embed = shapes.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"the GGUF file {files[0].name} has no token_embd.weight")
    fields["vocab_size"] = embed[0]
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [ARCHITECTURES[arch]]
    config.dtype = "bfloat16"
    raw = config.to_dict()
    counts = Counter(types.values())
    raw["quantization_config"] = {"quant_method": "gguf", "file_type": _file_type(counts),
                                  "tensor_types": dict(counts)}
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(files[0].parent), gguf_file=files[0].name)
    except Exception as e:
        raise ModelLoadError(f"transformers cannot build the tokenizer of {files[0]}: {type(e).__name__}: {e} "
                             "(or pass --tokenizer with an HF tokenizer)") from e
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    # the tensors' places in the files, so a load need not parse the metadata again (gguf-py reads a 150k-token
    # vocabulary's strings one by one: ~10 s)
    (folder / "gguf.json").write_text(json.dumps({"files": [str(f.resolve()) for f in files], "arch": arch,
                                                  "tensors": index}))
    log.info("GGUF %s: %s, tensors %s", files[0].name, arch, describe_types(counts))


def _file_type(counts: Counter) -> str:
    """A name for the mix (llama.cpp's file types by their main block type)."""
    blocks = {t: n for t, n in counts.items() if t in BLOCK_TYPES}
    if not blocks:
        return max(counts, key=counts.get) if counts else "F32"
    main = max(blocks, key=blocks.get)
    return f"{main}_M" if main in ("Q4_K", "Q5_K") and "Q6_K" in blocks else main


def gguf_folder_files(path: str) -> list[str] | None:
    """The GGUF files behind a folder ``prepare`` made, or None for any other folder."""
    spec = Path(path) / "gguf.json"
    if not spec.is_file():
        return None
    return json.loads(spec.read_text())["files"]


class _Tensor:
    """One tensor of the index, its data memory-mapped: float types typed, block types as bytes [rows, bytes]."""

    def __init__(self, name: str, type_name: str, shape: list[int], data):
        self.name, self.type_name, self.shape, self.data = name, type_name, tuple(shape), data
        self.tensor_type = _gguf().GGMLQuantizationType[type_name]


def hf_names(arch: str, num_layers: int, num_experts: int) -> dict[str, str]:
    """{GGUF tensor name: the checkpoint name MILI's loader takes}, for every tensor a model of ``arch`` has
    (gguf-py's TensorNameMap, read backwards); stacked experts map to their stem (split per expert on load)."""
    gguf = _gguf()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    candidates = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        candidates += [f"{p}.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
            "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")]
        if num_experts:
            candidates += [f"{p}.mlp.gate.weight"] + [f"{p}.mlp.experts.{n}.weight" for n in ("gate_proj", "up_proj",
                                                                                              "down_proj")]
    out = {}
    for name in candidates:
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if gguf_name is not None:
            out[gguf_name] = name
    return out


class GGUFWeights:
    """The tensors of a GGUF model (the folder ``prepare`` made), memory-mapped from its files by the index there;
    ``names`` maps each GGUF name to the checkpoint name MILI's loader takes."""

    def __init__(self, folder: str, num_layers: int, num_experts: int):
        import numpy as np

        gguf = _gguf()
        spec = json.loads((Path(folder) / "gguf.json").read_text())
        arch = spec["arch"]
        self.names = hf_names(arch, num_layers, num_experts)
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
        from mili.model.gguf_blocks import group_parts

        t = self.tensors[gguf_name]
        return group_parts(t.data, t.type_name, t.shape)
