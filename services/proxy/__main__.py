"""`python -m brigade_proxy ...` = `brigade proxy ...`."""

import typer

from brigade_proxy.cli import proxy

if __name__ == "__main__":
    typer.run(proxy)
