"""`python -m brigade_janitor ...` = `brigade janitor ...`."""

from brigade_janitor.cli import main

if __name__ == "__main__":
    main()
