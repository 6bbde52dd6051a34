"""The run-spec and wire-limits tables of docs/configuration.md, rendered from their declarations
(`brigade.spec.FIELDS`, `brigade.wire.WIRE_BOUNDS`) so neither can drift from them.

`with_table` rewrites the text between each pair of marker comments of a page;
`brigade_cli.docs_tables` (`make docs-tables`) writes these tables and the services' settings
tables into docs/configuration.md.
"""

from __future__ import annotations

from typing import Any

import yaml

from brigade.spec import FIELDS, Field
from brigade.wire import MAX_SAFE_INT, WIRE_BOUNDS

BEGIN = "<!-- spec-table:begin (generated from libs/brigade/brigade/spec.py by `make docs-tables`) -->"
END = "<!-- spec-table:end -->"
BOUNDS_BEGIN = "<!-- bounds-table:begin (generated from libs/brigade/brigade/wire.py by `make docs-tables`) -->"
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


def replace_between(doc: str, begin: str, end: str, table: str) -> str:
    """`doc` with the text between the markers `begin` and `end` replaced by `table`."""
    head, found_begin, rest = doc.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the page has no {begin!r} ... {end!r} markers")
    return f"{head}{begin}\n{table}\n{end}{tail}"


def with_table(doc: str) -> str:
    """`doc` with the text between each pair of markers replaced by the current table."""
    return replace_between(replace_between(doc, BEGIN, END, markdown_table()), BOUNDS_BEGIN, BOUNDS_END,
                           bounds_table())
