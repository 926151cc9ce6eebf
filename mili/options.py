"""Engine options, each written once: an ``EngineConfig`` field whose ``option(...)`` metadata generates its CLI
flag, its config-file key, the checks of its value and its row in the docs' option table
(docs/reference/options.md, written by mili/tools/reference.py). `mili serve`'s own options are ``ServerConfig``'s
fields the same way (mili/server_options.py), and `mili bench` takes some engine options' flags (``names``, with
its own ``defaults``).

    page_size: int = option(16, "tokens per KV page", minimum=1, section="kv_cache.page_size")

The rules that turn a field into a flag: ``--field-name`` (underscores become dashes) unless ``flag`` spells it
otherwise; a boolean that defaults to False is a switch that turns it on, one that defaults to True is a ``--no-x``
switch that turns it off; an int or float field's text is parsed as one; the one required field (``model``) is
the positional argument. Torch-free and argparse-only, so the CLI and the config file read it cheaply.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass


@dataclass(frozen=True)
class Option:
    """What a field's metadata says beyond its name, type and default."""

    help: str
    flag: str | None = None  # the CLI spelling where it is not --field-name (or --no-field-name)
    aliases: tuple[str, ...] = ()  # more spellings of the flag (-tp)
    cli: bool = True  # False: an LLM() keyword only, no flag and no config-file key
    choices: tuple | None = None  # the values the CLI offers (and the check accepts; None too where it is the default)
    accepts: tuple = ()  # more values the check accepts (LLM(dtype="bf16")), not offered on the CLI
    # numbers: the range accepted (minimum and maximum inclusive, above exclusive: gpu_memory_utilization's (0, 1]);
    # an integer option with minimum 1 is "a positive integer", 0 "a non-negative integer"; None passes (unset)
    minimum: int | float | None = None
    maximum: int | float | None = None
    above: int | float | None = None
    metavar: str | None = None
    section: str | None = None  # "inference.max_batch_size": also a key in one of the config file's sections
    mapping: str | None = None  # JSON text on the CLI, a mapping in a config file: what such a mapping holds
    listed: bool = False  # comma-separated text on the CLI, a list (or that text) in a config file
    nargs: str | None = None  # "+": one or more values after the flag (a list, or one text, in a config file)
    in_file: bool = True  # False: a flag no config-file key sets (--config itself)
    cli_default: str | None = None  # the positional's default (the required field has none: model, the demo)
    example: str | None = None  # a text value in the form the field's own check wants (its tests set it)
    # None (the default) is "auto": the execution plan picks the value (mili/runtime/plan.py); the CLI, the config
    # file and LLM() take the word auto for it, and the docs show it
    auto: bool = False


def option(default=MISSING, help: str = "", **meta) -> dataclasses.Field:
    """A dataclass field with its ``Option`` metadata (``default`` MISSING: a required field)."""
    return dataclasses.field(default=default, metadata={"option": Option(help=help, **meta)})


def options(cls) -> dict[str, tuple[dataclasses.Field, Option]]:
    """Every option field of ``cls`` by name, in the order they are declared."""
    return {f.name: (f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata}


def flag_of(field: dataclasses.Field, opt: Option) -> str | None:
    """The flag as users type it (None: the positional, or no flag at all)."""
    if not opt.cli or field.default is MISSING:
        return None
    if opt.flag:
        return opt.flag
    return ("--no-" if field.default is True else "--") + field.name.replace("_", "-")


AUTO = "auto"


def int_or_auto(text: str) -> int | None:
    """An auto option's CLI value: an integer, or ``auto`` (None: the plan picks it)."""
    return None if text.strip().lower() == AUTO else int(text)


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def value_type(cls, name: str):
    """int or float where the field holds one (beside None), else None: argparse keeps the text."""
    hint = _hints(cls)[name]
    kinds = set(typing.get_args(hint)) or {hint}
    return next((t for t in (int, float) if t in kinds), None)


def add_arguments(parser: argparse.ArgumentParser, cls, names: Iterable[str] | None = None,
                  defaults: dict | None = None) -> None:
    """One argparse argument per option field of ``cls``, in declaration order: every one, or those of ``names``;
    ``defaults``: other defaults than the fields' (mili bench's, which runs small)."""
    chosen, defaults = (None if names is None else set(names)), defaults or {}
    for name, (f, opt) in options(cls).items():
        if not opt.cli or (chosen is not None and name not in chosen):
            continue
        flag = flag_of(f, opt)
        if flag is None:  # the required field: an optional positional with the CLI's own default
            parser.add_argument(name, nargs="?", default=defaults.get(name, opt.cli_default), help=opt.help)
        elif isinstance(f.default, bool):  # (--x stores True, --no-x stores False)
            parser.add_argument(flag, *opt.aliases, dest=name, action="store_false" if f.default else "store_true",
                                help=opt.help)
        else:
            extra = {"choices": list(opt.choices)} if opt.choices else {}
            kind = int_or_auto if opt.auto else value_type(cls, name)
            if kind is not None:
                extra["type"] = kind
            metavar = opt.metavar or ("JSON" if opt.mapping else None)
            if metavar:
                extra["metavar"] = metavar
            if opt.nargs:
                extra["nargs"] = opt.nargs
            parser.add_argument(flag, *opt.aliases, dest=name, default=defaults.get(name, f.default), help=opt.help,
                                **extra)


def values_from(args: argparse.Namespace, cls, names: Iterable[str] | None = None) -> dict:
    """The option fields' values out of parsed arguments (those a parser of ``add_arguments`` made): every flag's,
    or those of ``names``."""
    chosen = None if names is None else set(names)
    return {name: getattr(args, name) for name, (_, opt) in options(cls).items()
            if opt.cli and (chosen is None or name in chosen)}


def actions_of(parser: argparse.ArgumentParser, cls) -> dict[str, argparse.Action]:
    """The parser's arguments that are option fields of ``cls``, by field name."""
    known = options(cls)
    return {a.dest: a for a in parser._actions if a.dest in known}


def sections(cls) -> dict[str, dict[str, str]]:
    """The config file's sections: {section: {key: field name}}, from the fields' ``section`` metadata."""
    found: dict[str, dict[str, str]] = {}
    for name, (_, opt) in options(cls).items():
        if opt.section:
            section, key = opt.section.split(".")
            found.setdefault(section, {})[key] = name
    return found


def _words(values) -> str:
    """'a, b or c'."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def range_words(opt: Option, kind) -> str | None:
    """What a number option must be, in words ("a positive integer", "a number in (0, 1]"); None: any number."""
    low, high, above = opt.minimum, opt.maximum, opt.above
    integer = kind is not float
    noun = "an integer" if integer else "a number"
    if high is None:
        if above is not None:
            return f"{noun} > {above}"
        if low is None:
            return None
        if integer and low in (0, 1):
            return "a positive integer" if low == 1 else "a non-negative integer"
        return f"{noun} >= {low}"
    if integer and low is not None:
        return f"an integer from {low} to {high}"
    left = f"({above}" if above is not None else f"[{low}" if low is not None else "(-inf"
    return f"{noun} in {left}, {high}]"


def in_range(opt: Option, kind, value) -> bool:
    """Whether ``value`` is a number of the option's kind (an int for an integer option) within its range."""
    if isinstance(value, bool) or not isinstance(value, int if kind is not float else (int, float)):
        return False
    return ((opt.minimum is None or value >= opt.minimum) and (opt.maximum is None or value <= opt.maximum)
            and (opt.above is None or value > opt.above))


def check_value(name: str, field: dataclasses.Field, opt: Option, value, kind=None) -> str | None:
    """What is wrong with ``value`` by the metadata's choices and range (None: nothing it can tell); ``kind``: the
    field's number type (value_type), int where it is None."""
    if value is None and field.default is None:
        return None
    if opt.choices is not None and value not in (*opt.choices, *opt.accepts):
        offered = [*opt.choices, *(["none"] if field.default is None else [])]
        return f"{name} must be {_words(offered)}, got {value!r}"
    words = range_words(opt, kind)
    if words and not in_range(opt, kind, value):
        return f"{name} must be {words}, got {value!r}"
    return None


def check(obj, error) -> None:
    """Every option field of the dataclass ``obj`` by its metadata: an auto field's word auto becomes None (the plan
    picks it), then the first wrong value raises ``error(message, param=name)``. (Frozen dataclasses too: their
    __post_init__ calls it before anything reads them.)"""
    cls = type(obj)
    for name, (field_, opt) in options(cls).items():
        value = getattr(obj, name)
        if opt.auto and isinstance(value, str) and value.strip().lower() == AUTO:
            value = None
            object.__setattr__(obj, name, None)  # (LLM(max_num_seqs="auto"): the plan picks it)
        wrong = check_value(name, field_, opt, value, value_type(cls, name))
        if wrong:
            raise error(wrong, param=name)


def check_names(cls, names, caller: str) -> None:
    """A TypeError naming the first of ``names`` that is no option of ``cls`` (with the nearest that is),
    as Python's own for an unexpected keyword argument, but saying what the keywords are."""
    known = options(cls)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r} ({hint}the engine options: "
                            f"{', '.join(known)})")


def markdown_table(cls) -> str:
    """The docs' option table (docs/reference/options.md): flag, LLM() keyword, config-file key, default, help."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    rows = ["| Flag | `LLM()` keyword | Config file | Default | What it sets |", "|---|---|---|---|---|"]
    for name, (f, opt) in options(cls).items():
        flag = flag_of(f, opt)
        value = (" {" + ",".join(map(str, opt.choices)) + "}" if opt.choices
                 else f" {opt.metavar or ('JSON' if opt.mapping else '')}".rstrip())
        aliases = "".join(f", `{a}`" for a in opt.aliases)
        shown = f"`{flag}{cell(value)}`{aliases}" if flag else "`MODEL` (positional)" if opt.cli else "—"
        keys = [f"`{opt.section}`"] if opt.section else []
        if opt.cli:
            keys.append(f"`{(flag or name).lstrip('-').replace('-', '_')}`")
        default = opt.cli_default if f.default is MISSING else AUTO if opt.auto else f.default
        rows.append(f"| {shown} | `{name}` | {' or '.join(keys) or '—'} | `{default}` | {cell(opt.help)} |")
    return "\n".join(rows) + "\n"
