"""The docs' generated reference: the CLI's arguments from its argparse parsers (mili/cli.py) and the engine options'
table from EngineConfig's fields (mili/options.py). Nothing here is written by hand, so it cannot drift from the code.

The pages keep each generated part between two markers,

    <!-- generated: NAME (python -m mili.tools.reference); do not edit by hand -->
    ...
    <!-- end of generated: NAME -->

``python -m mili.tools.reference`` rewrites them; ``--check`` exits 1 naming each stale one (the test suite runs it).
The tables are made from the parsers' actions, not from argparse's help formatter, whose layout depends on the
terminal's width and on the Python version.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mili import options
from mili.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
# page (relative to the repository) -> the generated parts it holds
PAGES = {
    "docs/reference/cli.md": ("cli-generate", "cli-embed", "cli-rerank", "cli-serve", "cli-bench", "cli-selftest"),
    "docs/reference/options.md": ("engine-options",),
}
_BEGIN = "<!-- generated: {name} (python -m mili.tools.reference); do not edit by hand -->\n"
_END = "<!-- end of generated: {name} -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _subcommands() -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Each `mili` subcommand's parser and its one-line help, from mili.cli's own parser."""
    from mili.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in action._choices_actions}
    return {name: (sub, helps[name]) for name, sub in action.choices.items()}


def _spelling(action: argparse.Action) -> str:
    if not action.option_strings:  # a positional
        if action.choices is not None:
            return "`{" + ",".join(str(c) for c in action.choices) + "}`"
        shown = action.metavar or action.dest.upper()
        return f"`{shown}`" + (" (optional)" if action.nargs == "?" else "")
    value = ""
    if action.nargs != 0:  # takes a value
        if action.choices is not None:
            value = " {" + ",".join(str(c) for c in action.choices if c is not None) + "}"
        else:
            value = f" {action.metavar or action.dest.upper()}"
    flags = [s for s in action.option_strings if s.startswith("--")] or list(action.option_strings)
    others = [s for s in action.option_strings if s not in flags]
    return ", ".join(f"`{f}{_cell(value)}`" if i == 0 else f"`{f}`" for i, f in enumerate(flags + others))


def _default(action: argparse.Action) -> str:
    if action.default is None or action.default == argparse.SUPPRESS:
        return "—"
    if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
        return "off"  # a switch
    return f"`{action.default}`"


def cli_table(name: str) -> str:
    """``mili NAME``'s own arguments (the engine options have their own page)."""
    parser, summary = _subcommands()[name]
    engine = {n for n, (_, opt) in options.options(EngineConfig).items() if opt.cli}
    rows = ["| Argument | Default | What it does |", "|---|---|---|"]
    shares = False
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.dest in engine and name in ("generate", "embed", "rerank", "serve"):
            shares = True
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            spelled = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            spelled = _spelling(action)
        rows.append(f"| {spelled} | {_default(action)} | {_cell(action.help or '')} |")
    head = f"`mili {name}`: {_cell(summary)}.\n\n"
    tail = ("\nIt also takes every engine option's flag: see [Engine options](options.md).\n" if shares else "")
    return head + "\n".join(rows) + "\n" + tail


def generated() -> dict[str, str]:
    """Every generated part by name."""
    parts = {f"cli-{name}": cli_table(name) for name in ("generate", "embed", "rerank", "serve", "bench", "selftest")}
    parts["engine-options"] = options.markdown_table(EngineConfig)
    return parts


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(_BEGIN.format(name=name)) + r"(.*?)" + re.escape(_END.format(name=name)), re.DOTALL)


def stale(root: Path = ROOT) -> list[str]:
    """'page: part' for each generated part that is missing or differs from what the code makes now."""
    parts, found = generated(), []
    for page, names in PAGES.items():
        text = (root / page).read_text()
        for name in names:
            match = _pattern(name).search(text)
            if match is None:
                found.append(f"{page}: {name} (its markers are missing)")
            elif match.group(1) != parts[name]:
                found.append(f"{page}: {name}")
    return found


def write(root: Path = ROOT) -> list[str]:
    """Rewrite every generated part in place; returns the pages changed."""
    parts, changed = generated(), []
    for page, names in PAGES.items():
        path = root / page
        text = new = path.read_text()
        for name in names:
            pattern = _pattern(name)
            if pattern.search(new) is None:
                raise SystemExit(f"{page}: no markers for {name}; add them where the part goes:\n"
                                 f"{_BEGIN.format(name=name)}{_END.format(name=name)}")
            new = pattern.sub(lambda _: _BEGIN.format(name=name) + parts[name] + _END.format(name=name), new)
        if new != text:
            path.write_text(new)
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mili.tools.reference",
                                     description="rewrite (or --check) the docs' generated reference")
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated part is stale; change nothing")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for line in found:
            print(f"stale: {line} (run python -m mili.tools.reference)", file=sys.stderr)
        return 1 if found else 0
    for page in write():
        print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
