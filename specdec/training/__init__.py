"""Training: the target's own responses as data, features, and the shared training loop."""
