"""The README's run-spec table, rendered from `brigade.spec.FIELDS` so the two cannot drift.

`python -m brigade.spec_table` prints it; `python -m brigade.spec_table --readme README.md` (what
`make spec-table` runs) rewrites the part of README.md between the two marker comments.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from brigade.spec import FIELDS, Field

BEGIN = "<!-- spec-table:begin (generated from libs/brigade/brigade/spec.py by `make spec-table`) -->"
END = "<!-- spec-table:end -->"


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


def with_table(readme: str) -> str:
    """`readme` with the text between the markers replaced by the current table."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the README has no {BEGIN!r} ... {END!r} markers")
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


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
