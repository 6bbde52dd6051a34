"""The generated tables of docs/configuration.md: every service's settings (from the settings class
each service command is built from), the run spec and the wire limits (`brigade.spec_table`).

`python -m brigade_cli.docs_tables docs/configuration.md` (what `make docs-tables` runs) rewrites the
text between each pair of marker comments of that page; `tests/unit/test_docs.py` fails while the
page differs from what this would write.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from brigade.settings import markdown_table
from brigade.spec_table import replace_between, with_table
from brigade_cli.main import SERVICE_COMMANDS

SETTINGS_BEGIN = ("<!-- settings-table:begin (generated from each service's settings declarations by "
                  "`make docs-tables`) -->")
SETTINGS_END = "<!-- settings-table:end -->"


def service_settings() -> dict[str, type]:
    """`brigade NAME` -> the settings class its command is built from, for every service command."""
    found = {}
    for name, (target, _distribution) in SERVICE_COMMANDS.items():
        module, attr = target.split(":")
        found[f"brigade {name}"] = getattr(importlib.import_module(module), attr).settings
    return found


def with_tables(doc: str) -> str:
    """`doc` with every generated table replaced by its current text."""
    return with_table(replace_between(doc, SETTINGS_BEGIN, SETTINGS_END, markdown_table(service_settings())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="the Markdown page to rewrite (docs/configuration.md)")
    page = parser.parse_args().page
    page.write_text(with_tables(page.read_text()))


if __name__ == "__main__":
    main()
