"""`python -m brigade_aggregator ...` = `brigade aggregator ...`."""

from brigade_aggregator.cli import main

if __name__ == "__main__":
    main()
