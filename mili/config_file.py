"""`mili serve --config FILE`: the original design's config layout (JSON or YAML), checked before loading.

    inference: {device, dtype, max_batch_size}     -> --device, --dtype, --max-num-seqs (a number, or auto)
    kv_cache:  {page_size, num_pages, dtype}       -> --page-size, --num-kv-pages (the pool, exactly),
                                                      --kv-cache-dtype (auto | fp8)
    sampling:  {temperature, top_p, top_k}         -> defaults for requests that leave them unset
    any other top-level key: a `mili serve` flag by its name (max_model_len: 4096, no_prefix_cache: true,
    speculative_config: {method: ngram, num_speculative_tokens: 3}, port: 8080)

Each key's checks are its option's metadata (mili/options.py: EngineConfig's and ServerConfig's fields).

Flags on the command line override the file. An unknown key, a wrong type or an impossible value is a
``ConfigFileError`` naming the key, raised before anything loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mili import options
from mili.config import EngineConfig
from mili.errors import InvalidRequest
from mili.server_options import ServerConfig

# {section: {key: EngineConfig field}}, from the fields' metadata (their `section`)
SECTIONS = options.sections(EngineConfig)
# every option a `mili serve` flag sets, by field name: (its Option, its number type or None)
OPTIONS = {name: (opt, options.value_type(cls, name)) for cls in (EngineConfig, ServerConfig)
           for name, (_, opt) in options.options(cls).items()}
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


class ConfigFileError(InvalidRequest):
    """A config file that cannot be used as written."""

    code = "invalid_config"


def read_config_file(path: str, parser: argparse.ArgumentParser) -> tuple[dict, dict]:
    """(flag values by argparse dest, sampling defaults) from ``path``, checked against ``parser``'s flags."""
    data = _parse(path)
    flags = {key: action for key, action in _flags(parser).items()
             if action.dest not in OPTIONS or OPTIONS[action.dest][0].in_file}
    values: dict[str, object] = {}
    sampling: dict[str, object] = {}
    where: dict[str, str] = {}  # dest -> the key that set it (to name both in a conflict)

    def put(key: str, action: argparse.Action, value) -> None:
        dest, converted = action.dest, _convert(path, key, action, value)
        if dest in where:
            raise ConfigFileError(f"{path}: {key} and {where[dest]} both set {dest}; keep one", param=key)
        where[dest] = key
        values[dest] = converted

    for key, value in data.items():
        if key in SECTIONS or key == "sampling":
            if not isinstance(value, dict):
                raise ConfigFileError(f"{path}: {key} must be a mapping, got {type(value).__name__}", param=key)
            for sub, sub_value in value.items():
                name = f"{key}.{sub}"
                if key == "sampling":
                    if sub not in SAMPLING_KEYS:
                        raise _unknown(path, name, f"sampling takes {', '.join(SAMPLING_KEYS)}")
                    sampling[sub] = sub_value
                elif sub not in SECTIONS[key]:
                    raise _unknown(path, name, f"{key} takes {', '.join(SECTIONS[key])}")
                else:
                    put(name, flags[SECTIONS[key][sub]], sub_value)
        elif key.replace("-", "_") in flags:
            put(key, flags[key.replace("-", "_")], value)
        else:
            raise _unknown(path, key, f"sections: {', '.join([*SECTIONS, 'sampling'])}; or a `mili serve` flag "
                                      f"by its name, e.g. max_model_len")
    return values, _check_sampling(path, sampling)


def _parse(path: str) -> dict:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        raise ConfigFileError(f"cannot read the config file {path!r}: {e.strerror or e}", param="config") from e
    try:
        if file.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
        raise ConfigFileError(f"{path} is not valid {'JSON' if file.suffix.lower() == '.json' else 'YAML'}: "
                              f"{e}", param="config") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} must hold a mapping of settings, got {type(data).__name__}", param="config")
    return data


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag of the parser by its long name with underscores (and the positional model)."""
    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = [o for o in action.option_strings if o.startswith("--")] or [action.dest]
        for name in names:
            flags[name.lstrip("-").replace("-", "_")] = action
    return flags


def _convert(path: str, key: str, action: argparse.Action, value):
    """The value argparse would have made of it, or an error naming the key."""
    def bad(what: str):
        return ConfigFileError(f"{path}: {key} must be {what}, got {value!r}", param=key)

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise bad("true or false")
        return action.const if value else action.default
    opt, kind = OPTIONS.get(action.dest, (None, None))
    if opt is not None and opt.auto:  # an integer, or auto (null too): the execution plan picks it
        if value is None or (isinstance(value, str) and value.strip().lower() == options.AUTO):
            return None
        if not options.in_range(opt, int, value):
            raise bad(f"{options.range_words(opt, int) or 'an integer'} or auto")
        return value
    if action.type in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (action.type is int
                                                                               and not isinstance(value, int)):
            raise bad("an integer" if action.type is int else "a number")
        value = action.type(value)
        words = opt and options.range_words(opt, kind)
        if words and not options.in_range(opt, kind, value):
            raise bad(words)
        return value
    if opt is not None and opt.mapping:  # a mapping (or its JSON): EngineConfig checks it
        if not isinstance(value, (dict, str)):
            raise bad(f"a mapping ({opt.mapping})")
        return value if isinstance(value, str) else json.dumps(value)
    if opt is not None and opt.listed and isinstance(value, list):  # a list of hosts, or their text
        if not all(isinstance(host, str) for host in value):
            raise bad("a list of host names")
        return ",".join(value)
    if opt is not None and opt.nargs:  # a list of texts, or one
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
            raise bad("a list of strings")
        return value
    if not isinstance(value, str):
        raise bad("a string")
    if action.choices is not None and value not in action.choices:
        raise bad(f"one of {', '.join(map(str, action.choices))}")
    return value


def _check_sampling(path: str, sampling: dict) -> dict:
    from mili.sampling_params import SamplingParams

    for key, value in sampling.items():
        number = int if key == "top_k" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            raise ConfigFileError(f"{path}: sampling.{key} must be {'an integer' if key == 'top_k' else 'a number'}, "
                                  f"got {value!r}", param=f"sampling.{key}")
    try:
        SamplingParams(**sampling)
    except InvalidRequest as e:
        raise ConfigFileError(f"{path}: sampling.{e}", param=f"sampling.{e.param}") from e
    return sampling


def _unknown(path: str, key: str, hint: str) -> ConfigFileError:
    return ConfigFileError(f"{path}: unknown key {key!r} ({hint})", param=key)
