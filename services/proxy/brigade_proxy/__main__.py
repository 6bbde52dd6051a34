"""`python -m brigade_proxy ...` = `brigade proxy ...`."""

from brigade_proxy.cli import main

if __name__ == "__main__":
    main()
