"""`python -m brigade_rollout ...` = `brigade rollout ...`."""

from brigade_rollout.cli import main

if __name__ == "__main__":
    main()
