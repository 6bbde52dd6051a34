"""`python -m brigade_learner ...` = `brigade learner ...`."""

from brigade_learner.cli import main

if __name__ == "__main__":
    main()
