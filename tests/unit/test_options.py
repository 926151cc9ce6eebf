"""Each engine option written once (mili/options.py): EngineConfig's field metadata makes the CLI flags, the config
file's keys, LLM()'s keyword checks and the docs' option table (docs/reference/options.md); these tests hold each
of them to the fields, and the flags and config-file sections users already type to what they were."""

from __future__ import annotations

import argparse
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
from mili.llm import LLM
from mili.server_options import ServerConfig

OPTIONS_PAGE = Path(__file__).parents[2] / "docs" / "reference" / "options.md"
OPTIONS = options.options(EngineConfig)
SERVER_OPTIONS = options.options(ServerConfig)

# The engine's flags as users type them (a contract: a renamed field must not rename its flag unnoticed)
ENGINE_FLAGS = {
    "--tokenizer", "--dtype", "--device", "--max-model-len", "--kv-cache-memory", "--num-kv-pages", "--page-size",
    "--num-state-slots", "--num-state-snapshots", "--max-num-seqs", "--max-num-batched-tokens", "--seed",
    "--num-threads", "--attention-backend", "--enforce-eager", "--async-scheduling", "--gpu-memory-utilization",
    "--quantization", "--lm-head-dtype", "--kv-cache-dtype", "--tensor-parallel-size", "-tp", "--no-cpu-kernels", "--cpu-isa",
    "--no-cpu-weight-prepack", "--no-prefix-cache", "--speculative-config", "--language-model-only",
    "--limit-mm-per-prompt", "--allowed-media-domains", "--allow-remote-media", "--allowed-local-media-path",
    "--schedule-policy", "--task", "--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"}
# `mili serve`'s own flags and their defaults (a contract too)
SERVER_FLAGS = {"--host": "127.0.0.1", "--port": 8000, "--served-model-name": None, "--api-key": None,
                "--max-queued-requests": 1024, "--shutdown-timeout": 10.0, "--tool-call-parser": "auto",
                "--api-server-count": 1, "--lora-modules": None, "--allow-runtime-lora-updating": False,
                "--reasoning-budget": None, "--reasoning-budget-message": None,
                "--reasoning-effort-budgets": "low=1024,medium=4096,high=16384", "--log-level": "info", "--config": None}


_ADDED: dict[int, tuple] = {}  # id(parser) -> (the parser, kept alive: ids are not reused; its arguments as added)


def _built_parser():
    """build_parser(), each argument its parsers took recorded as it was added (argparse lists a parser's arguments
    nowhere public; its add_argument and add_subparsers return each): --help's, and the subcommands' action."""
    add_argument, add_subparsers = argparse.ArgumentParser.add_argument, argparse.ArgumentParser.add_subparsers

    def recorded(add):
        def call(self, *args, **kwargs):
            action = add(self, *args, **kwargs)
            _ADDED.setdefault(id(self), (self, []))[1].append(action)
            return action
        return call

    argparse.ArgumentParser.add_argument, argparse.ArgumentParser.add_subparsers = map(recorded, (add_argument,
                                                                                                  add_subparsers))
    try:
        parser = build_parser()
    finally:
        argparse.ArgumentParser.add_argument, argparse.ArgumentParser.add_subparsers = add_argument, add_subparsers
    return parser


def _arguments(parser) -> list:
    """Every argument a parser (made by _built_parser) takes, --help's among them."""
    return _ADDED[id(parser)][1]


def _subparser(name: str):
    parser = _built_parser()
    return parser, next(a for a in _arguments(parser) if hasattr(a, "choices") and isinstance(a.choices, dict)
                        ).choices[name]


def _engine_actions(sub) -> dict:
    return {a.dest: a for a in _arguments(sub) if a.dest in OPTIONS}


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


def _sample(name: str, field, opt, cls=EngineConfig):
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
    if opt.nargs:
        return ["a=/x", "b=/y"], ["a=/x", "b=/y"]
    if opt.example is not None:
        return opt.example, opt.example
    kind = options.value_type(cls, name)
    if kind is not None:
        return kind(3) if kind is int else 0.5, kind(3) if kind is int else 0.5
    return "x", "x"


@pytest.mark.parametrize("cls, name", [(cls, n) for cls in (EngineConfig, ServerConfig)
                                       for n, (_, opt) in options.options(cls).items() if opt.cli and opt.in_file])
def test_each_option_by_its_config_file_key_and_its_flag(tmp_path, cls, name):
    """The file's key (the flag's name, underscored) and the flag itself set the field, and engine_kwargs (the
    server's: server_config) hands it on under the field's name."""
    from mili.cli import server_config

    field, opt = options.options(cls)[name]
    parser, serve = _subparser("serve")
    flag = options.flag_of(field, opt)
    key = (flag or name).lstrip("-").replace("-", "_")
    written, read = _sample(name, field, opt, cls)
    (tmp_path / "c.json").write_text(json.dumps({key: written}))
    values, _ = read_config_file(str(tmp_path / "c.json"), serve)
    assert values == {name: read}
    if flag is None:
        argv = ["serve", str(read)]
    elif isinstance(field.default, bool):
        argv = ["serve", flag]
    else:
        argv = ["serve", flag, *(read if isinstance(read, list) else [str(read)])]
    args = parser.parse_args(argv)
    taken = engine_kwargs(args) if cls is EngineConfig else dataclasses.asdict(server_config(args))
    assert taken[name] == read


def test_every_serve_flag_is_an_option_field():
    """No `mili serve` flag is written by hand: each argument is an EngineConfig or a ServerConfig field's, made
    from its metadata (the help, the choices, the default), and the server's flags are the ones users type."""
    serve = _subparser("serve")[1]
    fields = {**OPTIONS, **SERVER_OPTIONS}
    assert not set(OPTIONS) & set(SERVER_OPTIONS)
    for action in _arguments(serve):
        if action.dest == "help":
            continue
        assert action.dest in fields, f"mili serve {action.option_strings or action.dest} is no option's field"
        field, opt = fields[action.dest]
        assert action.help == opt.help and action.option_strings[:1] == [
            f for f in [options.flag_of(field, opt)] if f], action.dest
    server = options.actions_of(serve, ServerConfig)
    assert set(server) == set(SERVER_OPTIONS)
    assert {a.option_strings[0]: a.default for a in server.values()} == SERVER_FLAGS
    assert ServerConfig() == ServerConfig(**options.values_from(build_parser().parse_args(["serve"]), ServerConfig))


def test_every_config_file_key_is_an_option():
    """The config file's keys: its sections' (each an EngineConfig field's ``section``), sampling's, and at the top
    level each option's flag by its name; --config itself is none (``in_file``)."""
    from mili.config_file import OPTIONS as FILE_OPTIONS
    serve = _subparser("serve")[1]
    assert set(FILE_OPTIONS) == set(OPTIONS) | set(SERVER_OPTIONS)
    for action in _arguments(serve):  # (a key of the file: a flag's long name with underscores, or the model)
        assert action.dest in FILE_OPTIONS or action.dest == "help", action.option_strings or action.dest
    for section in SECTIONS.values():
        assert set(section.values()) <= set(OPTIONS)


def test_config_file_ranges_are_the_options_metadata(tmp_path):
    """A key's range is its option's (``minimum``/``maximum``/``above``), the same check EngineConfig and
    ServerConfig make: no list of names beside the metadata."""
    serve = _subparser("serve")[1]
    for text, message in [("port: 70000\n", "port must be an integer from 0 to 65535, got 70000"),
                          ("max_queued_requests: 0\n", "max_queued_requests must be a positive integer"),
                          ("api_server_count: 0\n", "api_server_count must be a positive integer"),
                          ("gpu_memory_utilization: 0\n", "gpu_memory_utilization must be a number in (0, 1]"),
                          ("max_model_len: 1\n", "max_model_len must be an integer >= 2"),
                          ("kv_cache_memory: 0\n", "kv_cache_memory must be a positive integer"),
                          ("num_threads: 0\n", "num_threads must be a positive integer"),
                          ("config: other.yaml\n", "unknown key 'config'"),
                          ("lora_modules: 3\n", "lora_modules must be a list of strings")]:
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ConfigFileError) as e:
            read_config_file(str(tmp_path / "bad.yaml"), serve)
        assert message in str(e.value), (text, str(e.value))
    (tmp_path / "one.yaml").write_text("lora_modules: a=/x\nport: 0\ngpu_memory_utilization: 1\n")
    assert read_config_file(str(tmp_path / "one.yaml"), serve)[0] == {
        "lora_modules": ["a=/x"], "port": 0, "gpu_memory_utilization": 1.0}


def test_ranges_are_checked_by_the_metadata_naming_the_option():
    for kwargs, message in [({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be a number in (0, 1]"),
                            ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a number in (0, 1]"),
                            ({"max_model_len": 1}, "max_model_len must be an integer >= 2, got 1"),
                            ({"kv_cache_memory": 0}, "kv_cache_memory must be a positive integer, got 0"),
                            ({"num_threads": 0}, "num_threads must be a positive integer, got 0")]:
        with pytest.raises(InvalidRequest, match=re.escape(message)) as e:
            EngineConfig("m", **kwargs)
        assert e.value.param == next(iter(kwargs))
    assert EngineConfig("m", gpu_memory_utilization=1).gpu_memory_utilization == 1
    for kwargs, message in [({"port": -1}, "port must be an integer from 0 to 65535, got -1"),
                            ({"api_server_count": 0}, "api_server_count must be a positive integer, got 0"),
                            ({"log_level": "loud"}, "log_level must be debug, info, warning or error")]:
        with pytest.raises(InvalidRequest, match=re.escape(message)) as e:
            ServerConfig(**kwargs)
        assert e.value.param == next(iter(kwargs))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerConfig().port = 1


def test_bench_takes_the_engine_options_flags():
    """`mili bench`'s engine flags are EngineConfig's fields' (their spelling, help and choices), with bench's own
    defaults stated in one place (mili/tools/bench.py's ENGINE_DEFAULTS); none of its other flags spells an engine
    option's."""
    from mili.tools.bench import ENGINE_DEFAULTS, ENGINE_OPTIONS

    bench = _subparser("bench")[1]
    engine = options.actions_of(bench, EngineConfig)
    assert set(engine) == set(ENGINE_OPTIONS) and set(ENGINE_DEFAULTS) <= set(ENGINE_OPTIONS)
    for name, action in engine.items():
        field, opt = OPTIONS[name]
        assert action.help == opt.help and (action.choices == list(opt.choices) if opt.choices else True), name
        expected = ENGINE_DEFAULTS.get(name, opt.cli_default if name == "model" else field.default)
        assert action.default == expected, name
    engine_flags = {o for a in _engine_actions(_subparser("serve")[1]).values() for o in a.option_strings}
    own = [a for a in _arguments(bench) if a.dest not in engine]
    assert not {o for a in own for o in a.option_strings} & engine_flags
    assert not {a.dest for a in own} & set(OPTIONS)


def test_the_generated_reference_is_current():
    """Every generated part of the docs (the option tables, each command's arguments) is what the code makes now."""
    from mili.tools import reference

    assert reference.stale() == [], "the docs' generated reference is stale: run python -m mili.tools.reference"


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


def test_the_engine_config_is_frozen_once_validated():
    """The start-up decides in the plan, never by writing back into the options: a validated config can't be
    changed, and loading a model leaves the asked task as asked (the resolved one is the engine's own)."""
    config = EngineConfig(model="demo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.task = "embed"
    llm = LLM(model="demo", task="auto")
    assert llm.engine.config.task == "auto" and llm.engine.inputs.task.name == "generate"
