"""`python -m brigade_evaluator ...` = `brigade evaluator ...`."""

from brigade_evaluator.cli import main

if __name__ == "__main__":
    main()
