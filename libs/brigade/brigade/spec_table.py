"""The README's run-spec table, rendered from `brigade.spec.FIELDS`, and its wire-limits table,
from `brigade.wire.WIRE_BOUNDS`, so neither can drift from its declarations.

`python -m brigade.spec_table` prints the first; `python -m brigade.spec_table --readme README.md`
(what `make spec-table` runs) rewrites the parts of README.md between each pair of marker comments.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from brigade.spec import FIELDS, Field
from brigade.wire import MAX_SAFE_INT, WIRE_BOUNDS

BEGIN = "<!-- spec-table:begin (generated from libs/brigade/brigade/spec.py by `make spec-table`) -->"
END = "<!-- spec-table:end -->"
BOUNDS_BEGIN = "<!-- bounds-table:begin (generated from libs/brigade/brigade/wire.py by `make spec-table`) -->"
BOUNDS_END = "<!-- bounds-table:end -->"


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):  # flow-style YAML, as a spec file would write it
        return f"`{yaml.safe_dump(value, default_flow_style=True).strip()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else ""
    return repr(value)


def _allowed(field: Field) -> str:
    if field.required:  # a spec file may leave it at its default; a CreateRun request may not
        return "required in CreateRun" if field.default else "required"
    if field.choices:
        return ", ".join(f"`{c}`" for c in field.choices)
    return field.bound if field.bound == "non-empty" else f"`{field.bound}`" if field.bound else ""


def markdown_table() -> str:
    rows = ["| field | default | allowed | meaning |", "|---|---|---|---|"]
    rows += [f"| `{f.path}` | {_default(f.default)} | {_allowed(f)} | {f.doc} |" for f in FIELDS]
    return "\n".join(rows)


def bounds_table() -> str:
    rows = ["| fields | at most | what |", "|---|---|---|"]
    grouped: dict[object, list[str]] = {}
    for name, b in WIRE_BOUNDS.items():  # one row per bound, listing every field it holds
        grouped.setdefault(b, []).append(name)
    for b, names in grouped.items():
        limit = f"{b.limit:,}" + (f" {b.unit}" if b.unit else "") + (", printable" if b.printable else "")
        rows.append(f"| {', '.join(f'`{n}`' for n in names)} | {limit} | {b.doc} |")
    rows.append(f"| any other 64-bit integer | {MAX_SAFE_INT:,} | what a Lua number holds exactly |")
    return "\n".join(rows)


def _replace(readme: str, begin: str, end: str, table: str) -> str:
    head, found_begin, rest = readme.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the README has no {begin!r} ... {end!r} markers")
    return f"{head}{begin}\n{table}\n{end}{tail}"


def with_table(readme: str) -> str:
    """`readme` with the text between each pair of markers replaced by the current table."""
    return _replace(_replace(readme, BEGIN, END, markdown_table()), BOUNDS_BEGIN, BOUNDS_END, bounds_table())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, help="rewrite the table inside this README instead of printing it")
    args = parser.parse_args()
    if args.readme is None:
        print(markdown_table())
    else:
        args.readme.write_text(with_table(args.readme.read_text()))


if __name__ == "__main__":
    main()
