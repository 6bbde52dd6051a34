"""brigade_rollout: the rollout worker (`brigade rollout`)."""
