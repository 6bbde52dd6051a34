"""brigade's aggregator: the learner of topology local_sgd (see aggregator.py)."""
