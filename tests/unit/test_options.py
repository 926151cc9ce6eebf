"""Each engine option written once (mili/options.py): EngineConfig's field metadata makes the CLI flags, the config
file's keys, LLM()'s keyword checks and the docs' option table (docs/reference/options.md); these tests hold each
of them to the fields, and the flags and config-file sections users already type to what they were."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest

from mili import options
from mili.cli import build_parser, engine_kwargs
from mili.config import EngineConfig
from mili.config_file import SECTIONS, ConfigFileError, read_config_file
from mili.errors import InvalidRequest

OPTIONS_PAGE = Path(__file__).parents[2] / "docs" / "reference" / "options.md"
OPTIONS = options.options(EngineConfig)

# The engine's flags as users type them (a contract: a renamed field must not rename its flag unnoticed)
ENGINE_FLAGS = {
    "--tokenizer", "--dtype", "--device", "--max-model-len", "--kv-cache-memory", "--num-kv-pages", "--page-size",
    "--num-state-slots", "--num-state-snapshots", "--max-num-seqs", "--max-num-batched-tokens", "--seed",
    "--num-threads", "--attention-backend", "--enforce-eager", "--async-scheduling", "--gpu-memory-utilization",
    "--quantization", "--lm-head-dtype", "--kv-cache-dtype", "--tensor-parallel-size", "-tp", "--no-cpu-kernels",
    "--no-cpu-weight-prepack", "--no-prefix-cache", "--speculative-config", "--language-model-only",
    "--limit-mm-per-prompt", "--allowed-media-domains", "--allow-remote-media", "--allowed-local-media-path",
    "--schedule-policy", "--task", "--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"}


def _subparser(name: str):
    parser = build_parser()
    return parser, next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                        ).choices[name]


def _engine_actions(sub) -> dict:
    return {a.dest: a for a in sub._actions if a.dest in OPTIONS}


def test_every_field_is_an_option_and_the_flags_are_the_ones_users_type():
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(EngineConfig)}
    for command in ("serve", "generate"):
        actions = _engine_actions(_subparser(command)[1])
        # every field has its flag but the one only LLM() takes (no flag was ever written for it)
        assert set(OPTIONS) - set(actions) == {"encoder_cache_tokens"}
        assert {o for a in actions.values() for o in a.option_strings} == ENGINE_FLAGS
        assert actions["model"].option_strings == [] and actions["model"].default == "demo"
        for name, action in actions.items():
            field, opt = OPTIONS[name]
            assert opt.help and action.help == opt.help
            if name != "model":
                assert action.default == field.default, name  # the CLI's defaults are EngineConfig's
            if opt.choices:
                assert action.choices == list(opt.choices)


def _sample(name: str, field, opt):
    """A value other than the default for the field's config-file key, and what the file makes of it."""
    if isinstance(field.default, bool):
        return True, not field.default  # (the key is the flag's name: no_prefix_cache: true turns it off)
    if opt.choices:
        choice = next(c for c in opt.choices if c != field.default)
        return choice, choice
    if opt.mapping:
        return {"a": 1}, json.dumps({"a": 1})
    if opt.listed:
        return ["a.example", "b.example"], "a.example,b.example"
    kind = options.value_type(EngineConfig, name)
    if kind is not None:
        return kind(3) if kind is int else 0.5, kind(3) if kind is int else 0.5
    return "x", "x"


@pytest.mark.parametrize("name", [n for n, (_, opt) in OPTIONS.items() if opt.cli])
def test_each_option_by_its_config_file_key_and_its_flag(tmp_path, name):
    """The file's key (the flag's name, underscored) and the flag itself set the field, and engine_kwargs hands it
    on to EngineConfig under the field's name."""
    field, opt = OPTIONS[name]
    parser, serve = _subparser("serve")
    flag = options.flag_of(field, opt)
    key = (flag or name).lstrip("-").replace("-", "_")
    written, read = _sample(name, field, opt)
    (tmp_path / "c.json").write_text(json.dumps({key: written}))
    values, _ = read_config_file(str(tmp_path / "c.json"), serve)
    assert values == {name: read}
    if flag is None:
        argv = ["serve", str(read)]
    elif isinstance(field.default, bool):
        argv = ["serve", flag]
    else:
        argv = ["serve", flag, str(read)]
    assert engine_kwargs(parser.parse_args(argv))[name] == read


def test_the_config_file_sections_are_the_original_designs():
    # (the key order is the order an unknown key's message lists them in)
    assert SECTIONS == {"inference": {"device": "device", "dtype": "dtype", "max_batch_size": "max_num_seqs"},
                        "kv_cache": {"page_size": "page_size", "num_pages": "num_kv_pages",
                                     "dtype": "kv_cache_dtype"}}
    assert [list(keys) for keys in SECTIONS.values()] == [["device", "dtype", "max_batch_size"],
                                                           ["page_size", "num_pages", "dtype"]]


def test_config_file_mistakes_name_the_key(tmp_path):
    serve = _subparser("serve")[1]
    for text, message in [
        ("inference:\n  max_batch_sise: 4\n",
         "unknown key 'inference.max_batch_sise' (inference takes device, dtype, max_batch_size)"),
        ("kv_cache:\n  size: 4\n", "kv_cache takes page_size, num_pages, dtype"),
        ("speculative_config: 3\n",
         "speculative_config must be a mapping (method, num_speculative_tokens, ...), got 3"),
        ("limit_mm_per_prompt: [1]\n", 'limit_mm_per_prompt must be a mapping ({"image": 4}), got [1]'),
        ("allowed_media_domains: [1]\n", "allowed_media_domains must be a list of host names"),
        ("kv_cache_dtype: fp8\nkv_cache:\n  dtype: auto\n",
         "kv_cache.dtype and kv_cache_dtype both set kv_cache_dtype"),
        ("encoder_cache_tokens: 4\n", "unknown key 'encoder_cache_tokens'"),
    ]:
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ConfigFileError) as e:
            read_config_file(str(tmp_path / "bad.yaml"), serve)
        assert message in str(e.value), (text, str(e.value))


def test_the_docs_table_is_what_the_fields_say():
    text = OPTIONS_PAGE.read_text()
    found = re.search(r"<!-- generated: engine-options \(python -m mili\.tools\.reference\); do not edit by hand -->\n"
                      r"(.*?)<!-- end of generated: engine-options -->", text, re.DOTALL)
    assert found, "docs/reference/options.md has lost its engine option table's markers"
    assert found.group(1) == options.markdown_table(EngineConfig), (
        "docs/reference/options.md's engine option table is stale: run python -m mili.tools.reference")


def test_the_table_has_a_row_for_every_field_with_its_flag_and_keys():
    rows = options.markdown_table(EngineConfig).splitlines()[2:]
    assert len(rows) == len(OPTIONS)
    by_keyword = {row.split(" | ")[1].strip("`"): row for row in rows}
    assert set(by_keyword) == set(OPTIONS)
    assert by_keyword["max_num_seqs"].startswith("| `--max-num-seqs` |")
    assert "`inference.max_batch_size` or `max_num_seqs`" in by_keyword["max_num_seqs"]
    assert by_keyword["enable_prefix_caching"].startswith("| `--no-prefix-cache` |")
    assert "`--tensor-parallel-size`, `-tp`" in by_keyword["tensor_parallel_size"]
    assert "auto \\| cpu \\| cuda \\| cuda:N" in by_keyword["device"]  # (a | would split the cell)


def test_an_unknown_llm_keyword_is_refused_by_name():
    from mili.llm import LLM

    # (refused before the model is looked for: the path does not exist)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'page_sise' \(did you mean 'page_size'\?"):
        LLM("/no/such/model", page_sise=16)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beam_width'.*max_num_seqs"):
        LLM("/no/such/model", beam_width=4)


def test_bad_llm_values_are_refused_naming_the_option():
    from mili.llm import LLM

    for kwargs, message in [({"page_size": 0}, "page_size must be a positive integer, got 0"),
                            ({"quantization": "int4"}, "quantization must be int8, fp8 or none, got 'int4'"),
                            ({"dtype": "int4"}, "dtype must be auto, bfloat16, float16 or float32, got 'int4'"),
                            ({"num_state_snapshots": -1}, "num_state_snapshots must be a non-negative integer"),
                            ({"schedule_policy": "sjf"}, "schedule_policy must be fcfs or lpm, got 'sjf'")]:
        with pytest.raises(InvalidRequest, match=re.escape(message)) as e:
            LLM("/no/such/model", **kwargs)
        assert e.value.param == next(iter(kwargs))
    assert EngineConfig("m", dtype="bf16", quantization=None).dtype == "bf16"  # (aliases the CLI does not offer)


def test_llm_signature_defaults_are_the_fields():
    from mili.llm import LLM

    for name, parameter in inspect.signature(LLM.__init__).parameters.items():
        if name in OPTIONS and parameter.default is not inspect.Parameter.empty:
            assert parameter.default == OPTIONS[name][0].default, name
