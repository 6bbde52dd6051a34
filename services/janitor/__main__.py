"""`python -m brigade_janitor ...` = `brigade janitor ...`."""

import typer

from brigade_janitor.cli import janitor

if __name__ == "__main__":
    typer.run(janitor)
